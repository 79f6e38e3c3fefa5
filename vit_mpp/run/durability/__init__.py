"""What makes a run survive a stop: checkpoints saved whole or not at all and restored newest first
(checkpoint.py), and the stop signals a run catches (preemption.py). docs/reliability.md."""
