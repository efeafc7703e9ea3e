"""What the command tells its user: lines of output that a closed reader never stops, and errors the user must fix,
shown as one line without a traceback."""

from __future__ import annotations

import os
import sys


class CliError(Exception):
    """A user-facing error: printed as one line, no traceback."""


def say(text: str) -> None:
    """Print a line for the user; a reader that went away (``| head``) never stops the command."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
