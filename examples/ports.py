"""How much a port changes: the code lines of a pathways file that differ from the JAX file it was ported from.

Module docstrings and blank lines aside; each example's ``python -m examples.NAME`` prints the diff.
"""

from __future__ import annotations

import ast
import difflib


def code_lines(path: str) -> list[str]:
    """The non-blank lines of ``path`` outside its module docstring."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc is not None else set()
    return [line for n, line in enumerate(source.splitlines(), 1) if n not in skip and line.strip()]


def changed_lines(before: str, after: str) -> tuple[int, list[str]]:
    """(number of code lines of ``after`` that are new or changed against ``before``, the unified diff)."""
    a, b = code_lines(before), code_lines(after)
    diff = list(difflib.unified_diff(a, b, before.rsplit("/", 1)[-1], after.rsplit("/", 1)[-1], lineterm="", n=0))
    return sum(1 for line in diff if line.startswith("+") and not line.startswith("+++")), diff
