"""The command line of every tool: `ArgumentParser`, argparse whose bad command line is a one-line `UsageError`
(vit_mpp/processes/exits.py `one_line_errors` prints it, once per run)."""

from __future__ import annotations

import argparse

from vit_mpp.errors import UserError


class UsageError(UserError):
    """A bad command line (unknown flag, missing argument, bad value); one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is a one-line `error: ...` (exit 2) like every other user mistake, printed
    once under a launcher (argparse prints its usage block and exits on every rank)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")
