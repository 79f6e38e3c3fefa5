"""How a build or an index stops for a reason other than the user's input, and its exit status: what build-shards'
command line (data_tools/cli.py) turns into one line."""

from __future__ import annotations


class BuildStopped(Exception):
    """The build stopped for a reason other than the user's input (a worker died, an upload kept failing, Ctrl-C);
    the message is one line and says that finished shards are kept. `status` is the exit status."""

    status = 1


class WorkerDied(BuildStopped):
    """A worker process ended abruptly (killed, out of memory, a crash in a decoder)."""


class Interrupted(BuildStopped):
    """Ctrl-C (SIGINT) or SIGTERM: the build stopped; finished shards are kept."""

    status = 130
