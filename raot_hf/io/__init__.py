"""Reading checkpoints: sources, configs before weights, compatibility checks and safe loading
(:mod:`raot_hf.io.loading`)."""
