"""Code shared by data_tools, pretrain and finetune: config, manifest, data stream, checkpoints."""
