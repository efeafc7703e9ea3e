"""The dataflow graph a ``@pw.program`` traces to: values, computations and transfers.

The graph is location-agnostic: it names virtual slices, not hosts. Lowering
(client/lowering.py) turns it into one Fragment per island.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from pathways.ops import Aval


@dataclass(frozen=True)
class Value:
    """One array flowing through the graph. ``slot`` is its position in the program."""

    slot: int
    shape: tuple[int, ...]
    dtype: np.dtype
    slice: Any  # client.slices.VirtualSlice
    spec: P

    @property
    def nbytes(self) -> int:
        """The array's size in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """Dtype and shape, e.g. ``float32[4, 4]``."""
        return f"{np.dtype(self.dtype).name}{list(self.shape)}"

    def aval(self) -> Aval:
        """Its shape and dtype in wire form."""
        return Aval(tuple(self.shape), np.dtype(self.dtype).name)


@dataclass(frozen=True)
class Compute:
    """A call of a compiled function (StableHLO) on one virtual slice."""

    name: str
    exe: str  # content hash of the serialized StableHLO
    slice: Any
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    donate: tuple[int, ...] = ()  # input positions whose buffers the call may reuse (their last use)


@dataclass(frozen=True)
class Transfer:
    """A value moved to another slice (and resharded to the consumer's spec)."""

    source: Value
    target: Value

    @property
    def name(self) -> str:
        """A label for graphs and traces."""
        return f"transfer {self.source.describe()}"

    @property
    def inputs(self) -> tuple[Value, ...]:
        """The value read: the source."""
        return (self.source,)

    @property
    def outputs(self) -> tuple[Value, ...]:
        """The value written: the target."""
        return (self.target,)


Node = Compute | Transfer


@dataclass
class Program:
    """A traced program: its inputs, nodes in execution order, and outputs."""

    name: str
    inputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    out_tree: Any = None

    @property
    def values(self) -> list[Value]:
        """Every value of the program: its inputs, then each node's outputs in execution order."""
        produced = [v for n in self.nodes for v in n.outputs]
        return self.inputs + produced

    @property
    def edges(self) -> list[tuple[int, int, Value]]:
        """(producer node index, consumer node index, value); inputs come from index -1."""
        producer = {v.slot: i for i, n in enumerate(self.nodes) for v in n.outputs}
        return [(producer.get(v.slot, -1), j, v) for j, n in enumerate(self.nodes) for v in n.inputs]

    @property
    def islands(self) -> frozenset[int]:
        """The islands the program's values live on."""
        return frozenset(v.slice.island for v in self.values)

    def to_dot(self) -> str:
        """Graphviz text: nodes coloured by island, transfers labelled with their bytes."""
        palette = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f6bd60"]
        lines = [f'digraph "{self.name}" {{', "  rankdir=LR;", '  node [style=filled, fontname="Helvetica"];']
        for v in self.inputs:
            lines.append(f'  in{v.slot} [label="input {v.describe()}", shape=plaintext, style=""];')
        for i, n in enumerate(self.nodes):
            if isinstance(n, Transfer):
                label = (f"{n.name}\\nisland {n.source.slice.island} -> {n.target.slice.island}"
                         f"\\n{n.source.nbytes} bytes")
                lines.append(f'  n{i} [label="{label}", shape=cds, fillcolor="#dddddd"];')
            else:
                color = palette[n.slice.island % len(palette)]
                label = f"{n.name}\\nisland {n.slice.island} {n.slice.shape}"
                lines.append(f'  n{i} [label="{label}", shape=box, fillcolor="{color}"];')
        for src, dst, v in self.edges:
            head = f"in{v.slot}" if src < 0 else f"n{src}"
            lines.append(f'  {head} -> n{dst} [label="{v.describe()}"];')
        producer = {v.slot: i for i, n in enumerate(self.nodes) for v in n.outputs}
        for k, v in enumerate(self.outputs):
            lines.append(f'  out{k} [label="output {k}", shape=plaintext, style=""];')
            head = f"n{producer[v.slot]}" if v.slot in producer else f"in{v.slot}"
            lines.append(f"  {head} -> out{k};")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def save(self, path: str) -> str:
        """Write the graph: ``.dot`` as Graphviz text; ``.svg``/``.png``/``.pdf`` rendered with Graphviz
        (``pip install 'pathways-ray[graph]'`` plus Graphviz's ``dot`` program). Returns the path written.

        Raises:
            ValueError: the suffix is none of those.
            ImportError: rendering needs the graphviz Python package, which is not installed.
            RuntimeError: rendering needs Graphviz's ``dot`` program, which is not on PATH.
        """
        fmt = check_renderer(path)
        if fmt == "dot":
            with open(path, "w") as f:
                f.write(self.to_dot())
            return path
        import graphviz

        data = graphviz.Source(self.to_dot()).pipe(format=fmt)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def __repr__(self) -> str:
        kinds = sum(isinstance(n, Compute) for n in self.nodes)
        return (f"Program({self.name!r}: {len(self.inputs)} inputs, {kinds} computations, "
                f"{len(self.nodes) - kinds} transfers, {len(self.outputs)} outputs, islands {sorted(self.islands)})")


RENDERED = ("svg", "png", "pdf")


def check_renderer(path: str) -> str:
    """The format ``path`` asks for (``dot``, or one of ``RENDERED``), once this machine is known to be able
    to write it, so that a caller can check before it does any work.

    Raises:
        ValueError: the suffix is none of .dot, .svg, .png, .pdf.
        ImportError: a rendered format needs the graphviz Python package, which is not installed.
        RuntimeError: a rendered format needs Graphviz's ``dot`` program, which is not on PATH.
    """
    fmt = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if fmt == "dot":
        return fmt
    if fmt not in RENDERED:
        raise ValueError(f"cannot tell the format of {path!r}; use .dot, .svg, .png or .pdf")
    try:
        import graphviz  # noqa: F401
    except ImportError:
        raise ImportError(f"rendering {path} needs the graphviz Python package: pip install 'pathways-ray[graph]' "
                          "(or write a .dot file, which needs nothing)") from None
    if shutil.which("dot") is None:
        raise RuntimeError(f"rendering {path} needs Graphviz's `dot` program, which is not on PATH: install "
                           "Graphviz (apt install graphviz, brew install graphviz, or https://graphviz.org/download) "
                           "(or write a .dot file, which needs nothing)")
    return fmt
