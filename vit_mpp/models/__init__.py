"""The model and the files that carry it between stages: building the timm ViT (vit.py), its FLOPs (flops.py) and
fp8 layers (fp8.py), exports (export.py, export_folder.py), model cards and the Hub (hub.py), and any checkpoint a
user brings (pretrained.py). docs/exports.md."""
