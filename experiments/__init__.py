"""Quality experiments: does pretraining earn its keep? `compare` runs MPP against its honest baselines per seed and
tables them (compare.py, the command; compare_arms.py, run_scheduler.py, compare_report.py and label_sweep.py, its
parts; monitor_ranks.py, which pretraining monitor ranks its arms as fine-tuning does); pool_labels.py measures what
could label a pool (k-NN, label propagation, a head) before a labeller is built; the data sets they run on are made
here (digits.py: scikit-learn's digits; cluttered_digits.py: a harder set, its images drawn by clutter_render.py);
pretrain_vs_scratch.py is the digits comparison in one command. Results and their commands: docs/results.md."""
