"""vit-mpp's shared code: what data_tools, pretrain, finetune and analysis all import (config, data stream,
checkpoints, exports, run directory). The stages depend on this package, never on each other's internals."""

__version__ = "0.5.0"  # the one version string: pyproject reads it, manifests and exports record it
