"""What makes a run survive a stop: checkpoints saved whole or not at all and restored newest first
(checkpoint.py), the checkpoint folders as files, without torch (checkpoint_files.py), and a sharded run's model
and optimizer in them (sharded_state.py). The signals that stop a run: vit_mpp/processes/. docs/reliability.md."""
