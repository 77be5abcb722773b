from raot_hf.zoo.images import build_vit, build_vit_pair, load_image_dataset
