"""The ``pathways`` console command's entry point: parse the arguments, run the subcommand, and turn what the user
must fix into one line on stderr (exit status 1) instead of a traceback. See ``command.parser`` for the commands."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from command.output import CliError
from command.parser import parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``pathways`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a kill or a closed terminal unwinds like Ctrl-C: nothing is left
        signal.signal(sig, _interrupted)
    try:
        return args.run(args) or 0
    except CliError as exc:
        print(f"pathways: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pathways status | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
