"""Being one rank of a launched group (`accelerate launch`, torchrun): a rank never outlives its launcher.

A launcher killed with -9 cannot stop its ranks; they would train on, holding the run directory, and a re-run would
meet a run it cannot see. So a rank watches its parent (the launcher) and stops when it is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

LAUNCHER_POLL_S = 1.0


def launched() -> bool:
    """Whether this process is a rank started by torch elastic (`accelerate launch`, torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def stop_with_launcher() -> None:
    """Under a launcher, end this rank when its launcher is gone (a daemon thread watches the parent process)."""
    if not launched():
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        print(f"error: [rank {os.environ.get('RANK', '?')}] the launcher (pid {parent}) is gone; this rank stops",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
