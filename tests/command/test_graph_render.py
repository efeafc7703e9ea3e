"""Rendering a program's graph on a machine without Graphviz: `pathways graph --out g.svg` says what is missing
and how to get it, in one line, before it runs the script; `Program.save` raises a clear error. The missing
parts are really missing: the graphviz package is made unimportable (a meta-path finder, installed through
sitecustomize in the command's own process), and `dot` is left off PATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pathways.graph import Program, Value

PATHWAYS = str(Path(sys.executable).parent / "pathways")
BLOCK_GRAPHVIZ = """
import sys

class NoGraphviz:
    def find_spec(self, name, path=None, target=None):
        if name == "graphviz" or name.startswith("graphviz."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoGraphviz())
"""


def script(tmp_path: Path) -> tuple[Path, Path]:
    """A script that leaves a mark when it runs (it would run a program, were it allowed to run)."""
    marker = tmp_path / "ran"
    path = tmp_path / "job.py"
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return path, marker


def pathways_graph(tmp_path: Path, env: dict[str, str], out: str = "g.svg") -> tuple[subprocess.CompletedProcess,
                                                                                      Path, Path]:
    path, marker = script(tmp_path)
    done = subprocess.run([PATHWAYS, "graph", f"{path}:step", "--out", str(tmp_path / out)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return done, marker, tmp_path / out


def test_without_the_graph_extra_the_command_says_how_to_get_it_before_running_the_script(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_GRAPHVIZ)
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    done, marker, out = pathways_graph(tmp_path, env)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"pathways: error: rendering {out} needs the graphviz Python package: pip install "
                           "'pathways-ray[graph]' (or write a .dot file, which needs nothing)\n")
    assert not marker.exists() and not out.exists()  # nothing ran, nothing written


def test_without_the_dot_program_the_command_says_how_to_get_it_before_running_the_script(tmp_path):
    pytest.importorskip("graphviz")
    no_dot = tmp_path / "bin"
    no_dot.mkdir()
    done, marker, out = pathways_graph(tmp_path, {**os.environ, "PATH": str(no_dot)}, out="g.png")
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"pathways: error: rendering {out} needs Graphviz's `dot` program, which is "
                                  "not on PATH: install Graphviz (apt install graphviz"), done.stderr
    assert not marker.exists() and not out.exists()


def test_an_unknown_format_is_refused_before_running_the_script(tmp_path):
    done, marker, out = pathways_graph(tmp_path, dict(os.environ), out="g.jpg")
    assert done.returncode == 1
    assert done.stderr == (f"pathways: error: cannot tell the format of {str(out)!r}; use .dot, .svg, .png or "
                           ".pdf\n")
    assert not marker.exists()


class FakeSlice:
    """The little of a slice the graph's text needs (an island and a shape): no cluster here."""

    island, shape, key = 0, (1,), "s0"


def tiny_program() -> Program:
    program = Program("step")
    program.inputs = [Value(0, (2,), np.dtype(np.float32), FakeSlice(), P())]
    program.outputs = list(program.inputs)
    return program


def test_saving_a_rendered_graph_without_graphviz_raises_what_to_install(tmp_path, monkeypatch):
    program = tiny_program()
    assert program.save(str(tmp_path / "g.dot")) == str(tmp_path / "g.dot")  # .dot needs nothing
    monkeypatch.setitem(sys.modules, "graphviz", None)  # `import graphviz` raises ImportError
    with pytest.raises(ImportError, match=r"needs the graphviz Python package: pip install 'pathways-ray\[graph\]'"):
        program.save(str(tmp_path / "g.svg"))
    monkeypatch.undo()
    pytest.importorskip("graphviz")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"needs Graphviz's `dot` program, which is not on PATH: install Graphviz"):
        program.save(str(tmp_path / "g.svg"))
    with pytest.raises(ValueError, match="use .dot, .svg, .png or .pdf"):
        program.save(str(tmp_path / "g.jpeg"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.dot"]
