"""``pathways graph script.py:function``: the dataflow graph of a program a script runs.

The script runs as ``__main__`` (so it starts, uses and stops its own cluster as usual); the named
``@pw.program`` keeps the graph it traced most recently, which is printed as Graphviz text or written
to a file (``.dot`` always; ``.svg``/``.png``/``.pdf`` with the optional graphviz extra and Graphviz's
``dot`` program). What ``--out`` needs is checked before the script runs, so a missing renderer costs
nothing and says how to get it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from command.output import CliError


def program_graph(target: str, out: str | None) -> str:
    """Run ``path.py:function`` and return the DOT text of its last trace (also written to ``out``)."""
    from client.program import ProgramFunction, recent_graph  # JAX loads here: the command starts without it
    from pathways.graph import check_renderer

    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise CliError(f"expected SCRIPT.py:FUNCTION, got {target!r}")
    if not os.path.isfile(path):
        raise CliError(f"no such script: {path}")
    if out:
        try:
            check_renderer(out)
        except (ValueError, ImportError, RuntimeError) as exc:
            raise CliError(str(exc)) from None
    saved_argv = sys.argv
    sys.argv = [path]
    try:
        scope = runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved_argv
    fn = scope.get(name)
    graph = fn.last_graph if isinstance(fn, ProgramFunction) else recent_graph(name)
    if graph is None:
        raise CliError(f"{path} ran no @pw.program called {name!r}; its graph exists once the program has run")
    if out:
        graph.save(out)
    return graph.to_dot()


def cmd_graph(args: argparse.Namespace) -> int:
    """``pathways graph``: run a script and print (or write) the graph of one of its programs."""
    dot = program_graph(args.target, args.out)
    print(f"wrote {args.out}" if args.out else dot, end="\n" if args.out else "")
    return 0
