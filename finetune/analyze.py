"""`python -m finetune.analyze` moved to `python -m analysis` (same arguments); this alias is kept for one release."""

import sys

from analysis.analyze import main
from vit_mpp.cli import run_main

if __name__ == "__main__":
    print("note: `python -m finetune.analyze` is now `python -m analysis`; this alias goes in the next release",
          file=sys.stderr)
    run_main(main)
