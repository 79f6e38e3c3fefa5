"""Looking at what was trained, from checkpoints and run directories on disk (nothing to do with training them):

    python -m analysis CHECKPOINT [--images ...] [--shards DIR]   the ViT paper's figures, parameter table (analyze.py)
    python -m analysis plot RUN_DIR [RUN_DIR ...]                training curves of runs, overlaid (plot_runs.py)
    python -m analysis summary RUN_DIR [RUN_DIR ...] [--csv FILE] a table of runs (run_table.py)
The figures' numbers (attention_stats.py) and drawings (paper_figures.py). Comparing recipes by training them is an
experiment: experiments/compare.py. See docs/analysis.md.
"""
