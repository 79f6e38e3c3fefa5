"""Entry-point plumbing: user errors (bad config, missing shards or checkpoint, bad data) become one line, exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from common.checkpoint import CheckpointError
from common.config import ConfigError
from common.data_stream import DataError
from common.manifest import ManifestError

USER_ERRORS = (ConfigError, ManifestError, CheckpointError, DataError)


def run_main(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> None:
    """Call `main(argv)`; print a user error as `error: ...` on one line and exit with status 2."""
    try:
        main(argv)
    except USER_ERRORS as e:
        # An error raised in a data-loader worker arrives wrapped with the worker's traceback: keep its last line.
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        message = lines[-1].split(": ", 1)[-1] if len(lines) > 1 else (lines[0] if lines else type(e).__name__)
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
