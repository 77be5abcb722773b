"""``python -m raot_hf`` (and ``accelerate launch -m raot_hf``) run the CLI."""

from raot_hf.cli import main

if __name__ == "__main__":
    main()
