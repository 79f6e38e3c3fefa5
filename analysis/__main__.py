"""`python -m analysis CHECKPOINT ...` (figures), `python -m analysis plot RUN_DIR ...` (curves),
`python -m analysis summary RUN_DIR ...` (a table of runs) or `python -m analysis compare ...` (pretraining against
its baselines, run and tabled): see __init__.py."""

import sys

from vit_mpp.cli import run_main

if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        from analysis.plot_runs import main as plot_main

        run_main(plot_main, sys.argv[2:])
    elif sys.argv[1:2] == ["summary"]:
        from analysis.run_table import main as summary_main

        run_main(summary_main, sys.argv[2:])
    elif sys.argv[1:2] == ["compare"]:
        from analysis.compare import main as compare_main

        run_main(compare_main, sys.argv[2:])
    else:
        from analysis.analyze import main

        run_main(main)
