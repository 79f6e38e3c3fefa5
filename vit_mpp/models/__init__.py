"""The model and the files that carry it between stages: building the timm ViT (vit.py), exports (export.py,
export_folder.py) and any checkpoint a user brings (pretrained.py). docs/exports.md."""
