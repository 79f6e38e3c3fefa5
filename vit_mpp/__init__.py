"""vit-mpp's shared code: what data_tools, pretrain, finetune and analysis all import, by floor (docs/architecture.md):
errors.py, durable.py, progress.py and cli.py at the root, then config/, processes/ (the process lifecycle), data/,
models/, tools/ and run/. The stages depend on this package, never on each other's internals."""

__version__ = "0.5.0"  # the one version string: pyproject reads it, manifests and exports record it
