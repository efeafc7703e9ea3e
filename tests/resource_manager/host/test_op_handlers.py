"""The host's one table from op class to handler: an op kind declared once (its class) with its handler (a
``Handler`` subclass) travels in a template and runs through a host's executor, with no other code knowing it."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

import pathways as pw
from pathways import op_wire
from pathways.op_wire import FREES, INT, Codec, on_wire
from pathways.ops import Exec, Limits, Op, Recv, Reshard, Send, Template, TemplateCache
from resource_manager.host import wiring
from resource_manager.host.buffers import Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.handlers import Handler, Unhandled
from resource_manager.host.run import Place, Run
from resource_manager.host.transport.peers import Peers

LIMITS = Limits(0, 2, 1, 4, 1 << 32, 1 << 32)
TENANT = "t"


@op_wire.declare("scale")
class Scale(Op):
    """Multiply a value by a constant: declared here, and nowhere else."""

    source: int = on_wire(INT, "in")
    out: int = on_wire(INT)
    factor: float = on_wire(Codec(float))
    frees: tuple[int, ...] = on_wire(FREES, default=())

    def reads(self) -> tuple[int, ...]:
        return (self.source,)

    def writes(self) -> tuple[int, ...]:
        return (self.out,)


class ScaleHandler(Handler, op=Scale):
    """What a host does with a ``Scale``."""

    def run(self, run: Run, op: Scale, final: bool) -> bool:
        entries = self.entries(run, (op.source,))
        if entries is None:
            return False
        self.table.put(run.rid(op.out), run.tenant, entries[0].value * op.factor)
        return True

    def waited_too_long(self, run: Run, op: Scale) -> Failure:
        return Failure("PathwaysError", f"scale by {op.factor} never got its input")


@op_wire.declare("orphan")
class Orphan(Op):
    """An op kind no host has a handler for."""

    out: int = on_wire(INT)
    frees: tuple[int, ...] = on_wire(FREES, default=())

    def writes(self) -> tuple[int, ...]:
        return (self.out,)


class Host:
    """One host's parts, wired as every host wires them, on this process's CPU devices."""

    def __init__(self, op_timeout: float = 5.0) -> None:
        self.parts = wiring.core(0, 0, 1, LIMITS, LocalDevices(0), Peers(0, 0, "node"), op_timeout, 60.0,
                                 lambda report: None)
        self.parts.grants.add_session(1, TENANT, b"k" * 32)
        self.table, self.executor, self.handlers = self.parts.table, self.parts.executor, self.parts.handlers
        self.templates = TemplateCache(check=lambda t: t.check(LIMITS))
        self.seq = 0

    def run(self, template: Template, base: int, inputs: tuple[int, ...]) -> Run:
        """Admit a call of ``template`` as the island would: from its bytes, decoded and checked once."""
        template = self.templates.get(template.encode(), TENANT)
        run = Run(self.seq, TENANT, 1, template.program, template.ops, template, template.n_inputs, base, inputs)
        self.seq += 1
        self.executor.admit(run)
        return run

    def fetch(self, buffer_id: int) -> np.ndarray:
        entry = self.table.wait(buffer_id, TENANT, 20.0)
        assert entry is not None, f"buffer {buffer_id} never came"
        if isinstance(entry.value, Failure):
            raise pw.errors.from_wire(entry.value.kind, entry.value.message)
        return np.asarray(entry.value)


@pytest.fixture
def host():
    h = Host()
    yield h
    h.executor.stop()


def test_an_op_declared_once_with_its_handler_travels_and_runs(host):
    host.table.put(100, TENANT, jax.device_put(np.arange(4, dtype=np.float32)))
    chain = Template("scaled", 1, 3, {}, (Scale(0, 1, 2.0), Scale(1, 2, 0.5, frees=(1,))))
    host.run(chain, base=1000, inputs=(100,))
    np.testing.assert_allclose(host.fetch(1002), [0, 1, 2, 3])
    assert type(host.handlers.by_op[Scale]) is ScaleHandler


def test_a_waiting_op_is_told_and_timed_out_by_its_handler():
    host = Host(op_timeout=0.5)
    try:
        host.run(Template("starved", 1, 2, {}, (Scale(0, 1, 3.0),)), base=1000, inputs=(404,))
        deadline = time.monotonic() + 10
        while not host.executor.stalled(TENANT) and time.monotonic() < deadline:
            time.sleep(0.01)
        (stuck,) = host.executor.stalled(TENANT)
        assert stuck["kind"] == "scale" and stuck["missing"] == ["buffer 404"]
        with pytest.raises(pw.PathwaysError, match="scale by 3.0 never got its input"):
            host.fetch(1001)
    finally:
        host.executor.stop()


def test_an_op_no_handler_takes_fails_its_outputs(host):
    host.run(Template("orphaned", 0, 1, {}, (Orphan(0),)), base=1000, inputs=())
    with pytest.raises(pw.ProgramError, match="unknown op Orphan"):
        host.fetch(1000)
    assert type(host.handlers.by_op[Orphan]) is Unhandled


def test_every_runtime_op_has_one_handler_and_says_what_the_executor_does_differently(host):
    by_op = host.handlers.by_op
    for op in (Exec, Send, Recv, Reshard, Place):
        assert type(by_op[op]).op is op
    assert [op for op, h in by_op.items() if h.computes] == [Exec]
    assert [op for op in by_op if op.RECEIVES] == [Recv]
    with pytest.raises(TypeError, match="'scale' has a handler already: ScaleHandler"):
        type("Again", (Handler,), {}, op=Scale)
