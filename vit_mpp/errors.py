"""The one base class of user errors: a mistake in what the user gave (a config value, a path, a file, the data);
and a stop's outcome (`Stopped` and its kinds: its line and its exit status).

Every entry point (`vit_mpp.processes.exits.run_main`) turns a `UserError` into one line, `error: ...`, and exit
status 2. Anything else is a bug and keeps its traceback. Subclasses live beside the code that raises them
(ConfigError in vit_mpp/config/engine.py, ManifestError in vit_mpp/data/manifest.py, ...), so a module never needs
the CLI to raise one.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input, reported as one line; the message must be a single line meant for a user.

    `rank_local` (a class attribute, so it survives the re-raise of an error from a data-loader worker): only this
    rank met the error (a bad sample in its own range), so this rank reports it; otherwise every rank meets the
    same error and the main process alone reports it.
    """

    rank_local = False


EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a checkpoint of the step named exists; the same command resumes
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


class Stopped(Exception):
    """Stopped by a signal, with a line that says what a rerun does (printed, not an `error:`) and the exit status
    `status`: 75 when the same command resumes, 128 + the signal's number when nothing was saved."""

    def __init__(self, line: str, status: int = EXIT_PREEMPTED) -> None:
        super().__init__(line)
        self.status = status


class Preempted(Stopped):
    """The run stopped on a preemption signal at `step`, whose checkpoint exists: saved now, or before (a run
    stopped before its first new step). Exit status 75."""

    def __init__(self, step: int, saved_now: bool = True) -> None:
        saved = "checkpoint saved" if saved_now else "its checkpoint was saved before"
        super().__init__(f"preempted at step {step}: {saved}; run the same command to resume")
        self.step = step


class StoppedUnsaved(Stopped):
    """The run stopped on signal `signum` before anything was saved (a new run, before its first step): exit status
    128 + the signal's number, as for a process the signal ended, and a line that says so."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(f"preempted ({name}) before the first step: nothing was saved; run the same command to "
                         "start", 128 + signum)


class StoppedWriting(BaseException):
    """A tool stopped by a signal while it wrote an output (vit_mpp/tools/args.py `stopped_as_exception`), with its
    line and exit status `status` (128 + the signal's number). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` it passes through (an image decoder's, which reports any failure as a bad image) takes it
    for that code's own failure."""

    def __init__(self, line: str, status: int) -> None:
        super().__init__(line)
        self.status = status
