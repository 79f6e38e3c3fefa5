"""What the command-line tools share: checks of `--device` and the outputs (args.py), figures (figures.py)."""
