"""The model and the files that carry it between stages: building the timm ViT (vit.py), its FLOPs (flops.py) and
fp8 layers (fp8.py), exports (export.py, export_folder.py), model cards and the Hub (hub.py), any checkpoint a user
brings (pretrained.py; each format's weights file: weight_files.py), and k-NN classification of its features
(knn.py). docs/exports.md."""
