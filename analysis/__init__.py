"""Looking at what was trained: the ViT paper's analysis figures for any checkpoint, and training curves of runs.

    python -m analysis CHECKPOINT [--images ...] [--shards DIR]     figures and a parameter table (analyze.py, drawn
                                                                    by paper_figures.py from attention_stats.py)
    python -m analysis plot RUN_DIR [RUN_DIR ...] [--out curves.png] training curves of runs, overlaid (compare_runs.py)
    python -m analysis summary RUN_DIR [RUN_DIR ...] [--csv FILE]    a table of runs: settings, final and best metrics,
                                                                    wall time (run_table.py)

It reads checkpoints and run directories (files on disk) and has nothing to do with training them.
"""
