"""Put values parked on a host until their put takes them (``resource_manager.host.uploads``): the tenant's
``parked_bytes`` budget, ownership, refusals, expiry, and what a snapshot keeps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pathways.errors import ResourceError, TenantAccessError
from resource_manager.host.buffers import Failure
from resource_manager.host.uploads import REFUSALS, Uploads

REGION = ((0, 2), (0, 3))


class Wakes:
    """Counts the uploads' wake-ups (a put op waiting for its bytes is woken by them)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def pieces(value: float = 1.0) -> dict:
    return {REGION: np.full((2, 3), value, np.float32)}


@pytest.fixture
def wakes() -> Wakes:
    return Wakes()


@pytest.fixture
def uploads(wakes) -> Uploads:
    return Uploads(ttl=3600.0, wake=wakes)


def test_a_reserved_upload_is_taken_once_its_pieces_arrive_and_its_bytes_are_released(uploads, wakes):
    uploads.reserve(7, "a", 24, budget=100)
    assert uploads.held("a") == 24 and wakes.count == 0
    assert uploads.take(7, "a") is None  # reserved, its bytes still on their way
    uploads.fill(7, pieces(2.0))
    assert wakes.count == 1  # a put op waiting for it looks again
    got = uploads.take(7, "a")
    np.testing.assert_array_equal(got[REGION], np.full((2, 3), 2.0, np.float32))
    assert uploads.held("a") == 0 and uploads.take(7, "a") is None  # taken once


def test_a_tenant_over_its_parked_bytes_budget_is_refused_before_the_bytes_are_read(uploads):
    uploads.reserve(1, "a", 60, budget=100)
    with pytest.raises(ResourceError, match=r"over your parked_bytes budget: you hold 60 bytes and this needs 50 "
                                            r"bytes more, over the limit of 100 bytes; free something first"):
        uploads.reserve(2, "a", 50, budget=100)
    assert uploads.held("a") == 60  # the refused reservation took nothing
    uploads.reserve(3, "a", 40, budget=100)  # up to the limit exactly is allowed, not a byte more
    with pytest.raises(ResourceError, match="you hold 100 bytes and this needs 1 bytes more"):
        uploads.reserve(5, "a", 1, budget=100)
    uploads.reserve(4, "b", 100, budget=100)  # budgets are per tenant
    assert (uploads.held("a"), uploads.held("b")) == (100, 100)


def test_an_id_uploaded_twice_is_refused_and_the_first_upload_kept(uploads):
    uploads.reserve(5, "a", 24, budget=100)
    uploads.fill(5, pieces(1.0))
    with pytest.raises(TenantAccessError, match="put 5 was already uploaded; a put's value is sent once"):
        uploads.reserve(5, "b", 24, budget=100)  # not by its own tenant, nor by another
    assert uploads.held("b") == 0
    np.testing.assert_array_equal(uploads.take(5, "a")[REGION], 1.0)


def test_another_tenant_can_neither_take_an_upload_nor_learn_its_refusal(uploads):
    uploads.reserve(5, "a", 24, budget=100)
    uploads.fill(5, pieces())
    uploads.refuse(6, "a", Failure("ResourceError", "over budget"))
    assert uploads.take(5, "b") is None and uploads.take(6, "b") is None
    assert uploads.held("a") == 24  # still there for its owner
    assert uploads.take(5, "a") is not None
    assert uploads.take(6, "a") == Failure("ResourceError", "over budget")


def test_a_refused_upload_fails_its_put_once_and_wakes_it(uploads, wakes):
    uploads.refuse(9, "a", Failure("WireFormatError", "malformed"))
    assert wakes.count == 1
    assert uploads.take(9, "a") == Failure("WireFormatError", "malformed")
    assert uploads.take(9, "a") is None  # the reason is handed over once


def test_only_the_latest_refusals_are_remembered(uploads):
    for i in range(REFUSALS + 10):
        uploads.refuse(i, "a", Failure("ResourceError", str(i)))
    assert len(uploads.saved()[1]) == REFUSALS
    assert uploads.take(9, "a") is None  # the oldest went first
    assert uploads.take(10, "a") == Failure("ResourceError", "10")
    assert uploads.take(REFUSALS + 9, "a") == Failure("ResourceError", str(REFUSALS + 9))


def test_a_cancelled_reservation_gives_its_bytes_back_and_a_late_fill_is_ignored(uploads, wakes):
    uploads.reserve(3, "a", 80, budget=100)
    uploads.cancel(3)
    assert uploads.held("a") == 0
    uploads.fill(3, pieces())  # the bytes of a cancelled upload: nothing to fill
    assert uploads.take(3, "a") is None and uploads.held("a") == 0 and wakes.count == 0
    uploads.cancel(3)  # twice, or for an id never reserved: harmless
    uploads.cancel(12345)
    uploads.reserve(3, "a", 100, budget=100)


def test_uploads_nothing_claims_within_the_ttl_expire_and_release_their_bytes(uploads):
    uploads.reserve(1, "a", 10, budget=100)
    uploads.reserve(2, "a", 10, budget=100)
    uploads.fill(2, pieces())
    assert uploads.expire() == 0  # within the hour
    uploads.ttl = -1.0  # every upload is now older than the ttl
    assert uploads.expire() == 2
    assert uploads.held("a") == 0 and uploads.take(2, "a") is None
    assert uploads.expire() == 0


def test_a_client_whose_session_ended_loses_its_uploads_only(uploads):
    def client_of(buffer_id: int) -> int:
        return buffer_id >> 8

    uploads.reserve(1 << 8 | 1, "a", 10, budget=100)
    uploads.reserve(1 << 8 | 2, "a", 10, budget=100)
    uploads.reserve(2 << 8 | 1, "a", 10, budget=100)
    uploads.drop_client(client_of, 1)
    assert uploads.held("a") == 10
    uploads.fill(2 << 8 | 1, pieces())
    assert uploads.take(2 << 8 | 1, "a") is not None


def test_a_snapshot_keeps_whole_uploads_and_refusals_and_a_restore_parks_them_again(uploads):
    uploads.reserve(1, "a", 24, budget=100)  # still arriving: a snapshot does not keep it
    uploads.reserve(2, "a", 24, budget=100)
    uploads.fill(2, pieces(3.0))
    uploads.refuse(4, "b", Failure("ResourceError", "no"))
    whole, refused = uploads.saved()
    assert [(i, t) for i, t, _ in whole] == [(2, "a")]
    assert refused == [(4, "b", Failure("ResourceError", "no"))]

    again = Uploads(ttl=3600.0, wake=lambda: None)
    for i, tenant, kept in whole:
        again.restore(i, tenant, kept)
    assert again.held("a") == 24  # counted against its tenant as before
    np.testing.assert_array_equal(again.take(2, "a")[REGION], 3.0)
    assert again.held("a") == 0


def test_concurrent_reservations_never_take_a_tenant_over_its_budget(uploads):
    """Reservations come from every client connection's thread at once: the budget holds exactly."""
    granted: list[int] = []
    refused: list[int] = []
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        start.wait(timeout=30)
        for j in range(100):
            buffer_id = k * 1000 + j
            try:
                uploads.reserve(buffer_id, "a", 10, budget=500)
                granted.append(buffer_id)
            except ResourceError:
                refused.append(buffer_id)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(granted) == 50 and len(refused) == 750 and uploads.held("a") == 500
