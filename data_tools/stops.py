"""How a build or an index stops for a reason other than the user's input, and its exit status: what build-shards'
command line (data_tools/cli.py) turns into one line."""

from __future__ import annotations

import signal

from vit_mpp.errors import EXIT_INTERRUPTED

# What stops a build or an index as Ctrl-C does (data_tools/cli.py turns SIGTERM into KeyboardInterrupt); their
# poll loops take them through vit_mpp/processes/signal_handlers.py `deferred`, so they raise between waits.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class BuildStopped(Exception):
    """The build stopped for a reason other than the user's input (a worker died, an upload kept failing, Ctrl-C);
    the message is one line and says that finished shards are kept. `status` is the exit status."""

    status = 1


class WorkerDied(BuildStopped):
    """A worker process ended abruptly (killed, out of memory, a crash in a decoder)."""


class Interrupted(BuildStopped):
    """Ctrl-C (SIGINT) or SIGTERM: the build stopped; finished shards are kept."""

    status = EXIT_INTERRUPTED
