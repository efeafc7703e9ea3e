"""Where the suite's files are: the scripts here that tests run by path in processes of their own, and the checkout
(the README, examples/) that some tests read or run from. The tests sit in folders by the code they test, at
different depths; their paths are these, never their own ``__file__``'s."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]


def script(name: str) -> str:
    """The path of tests/support/``name``, a script that a test runs in a process of its own."""
    path = SUPPORT / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not there: the scripts tests run by path live in {SUPPORT}")
    return str(path)
