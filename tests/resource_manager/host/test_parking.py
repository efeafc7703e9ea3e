"""The parked runs of a multi-host island: who parks, who parks behind whom, and what a resume brings back."""

from __future__ import annotations

from pathways.ops import Exec, Template
from resource_manager.host.buffers import BufferTable
from resource_manager.host.parking import Parking
from resource_manager.host.run import Run

TENANT = "t"


def run_of(seq: int, base: int, inputs: tuple[int, ...]) -> Run:
    """A one-op run reading slot 0 (``inputs[0]``) and writing slot 1 (id ``base + 1``)."""
    op = Exec("exe", "s1", (0,), (1,), ((),), ((),), f"op{seq}")
    template = Template(f"p{seq}", 1, 2, {}, (op,))
    return Run(seq, TENANT, 1, template.program, template.ops, template, 1, base, inputs)


def test_a_reader_of_what_a_parked_run_will_write_parks_behind_it_and_resumes_right_after_it():
    parking, table = Parking(), BufferTable()
    writer, reader = run_of(0, 1000, (100,)), run_of(1, 2000, (1001,))
    parking.park(writer)
    assert writer.parked and parking.count() == 1
    producer = parking.producer(reader.ids((0,)), table)
    assert producer == 0
    parking.park_behind(reader, producer)
    assert reader.parked and parking.count() == 2
    third = run_of(2, 3000, (2001,))  # reads what the run parked behind the writer will write
    assert parking.producer(third.ids((0,)), table) == 0
    assert parking.resume(0, 0) == [writer, reader]
    assert not writer.parked and not reader.parked and writer.resumed_at == 0 and parking.count() == 0
    # resumed, not finished: a host that reaches ``third`` only now must still find who will write its input
    assert parking.producer(third.ids((0,)), table) == 0 and not parking.is_parked(0)
    assert parking.returned(0) == [writer, reader] and parking.expecting
    parking.finished(0)
    assert parking.producer(third.ids((0,)), table) is None  # what the writer would write is no one's future now
    assert parking.returned(0) == [] and not parking.expecting


def test_a_value_already_present_or_written_by_no_parked_run_parks_nothing():
    parking, table = Parking(), BufferTable()
    parking.park(run_of(0, 1000, (100,)))
    table.put(1001, TENANT, 1.0, nbytes=4)
    assert parking.producer([1001], table) is None
    assert parking.producer([555], table) is None


def test_a_resume_of_a_run_not_parked_at_that_op_brings_nothing_back():
    parking = Parking()
    assert parking.resume(7, 0) is None
    run = run_of(3, 1000, (100,))
    parking.park(run)
    assert parking.resume(3, 1) is None  # parked at op 0, not 1
    assert parking.count() == 0


def test_a_dead_host_takes_every_parked_run_once():
    parking, table = Parking(), BufferTable()
    writer, reader = run_of(0, 1000, (100,)), run_of(1, 2000, (1001,))
    parking.park(writer)
    parking.park_behind(reader, parking.producer([1001], table))
    assert parking.take_all() == [writer, reader]
    assert parking.count() == 0 and parking.take_all() == [] and parking.parked == {}
