"""`python -m analysis CHECKPOINT ...` (figures), `python -m analysis plot RUN_DIR ...` (curves) or
`python -m analysis summary RUN_DIR ...` (a table of runs): see __init__.py."""

import sys

from vit_mpp.cli import UsageError
from vit_mpp.processes.exits import run_main


def moved(argv: list[str] | None) -> None:
    raise UsageError("compare trains runs, so it is an experiment now: python -m experiments.compare ...")


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        from analysis.plot_runs import main as plot_main

        run_main(plot_main, sys.argv[2:])
    elif sys.argv[1:2] == ["summary"]:
        from analysis.run_table import main as summary_main

        run_main(summary_main, sys.argv[2:])
    elif sys.argv[1:2] == ["compare"]:
        run_main(moved, sys.argv[2:])
    else:
        from analysis.analyze import main

        run_main(main)
