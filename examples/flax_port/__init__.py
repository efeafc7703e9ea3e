"""Porting a Flax NNX training loop to pathways (needs ``pip install 'pathways-ray[flax]'``).

``jax_train.py`` is the loop as a Flax user writes it with plain JAX;
``pw_train.py`` is the same file moved onto a pathways slice. ``changed_lines``
counts the code lines that differ (module docstrings and blank lines aside),
and ``python -m examples.flax_port`` runs both and compares their losses.
"""

from __future__ import annotations

import ast
import difflib
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _code_lines(path: str) -> list[str]:
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc is not None else set()
    return [line for n, line in enumerate(source.splitlines(), 1) if n not in skip and line.strip()]


def changed_lines() -> tuple[int, list[str]]:
    """(number of code lines of pw_train.py that are new or changed against jax_train.py, the unified diff)."""
    a, b = _code_lines(os.path.join(HERE, "jax_train.py")), _code_lines(os.path.join(HERE, "pw_train.py"))
    diff = list(difflib.unified_diff(a, b, "jax_train.py", "pw_train.py", lineterm="", n=0))
    changed = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    return changed, diff
