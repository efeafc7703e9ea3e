"""The client protocol's requests and answers, each defined once: a frozen dataclass whose fields are its
wire schema (``pathways.wire.declare``), checked in meaning by its ``check`` when ``wire.parse`` decodes it.

A request that expects an answer carries ``rid``, the client's number for it on that connection; the
endpoint answers with ``Answer`` (the same ``rid``; the value, or the error as (kind, message)), and array
bytes follow the answer in its frame. Who sends a request is never a field: the connection it arrives on was
proven for one session (``pathways.protocol``), and the resource manager says which tenant that is.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pathways import wire
from pathways.errors import WireFormatError
from pathways.wire import declare

REGION = ("list", ("list", int))  # [[start, stop], ...] per dimension


def _finite(value: float, what: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise WireFormatError(f"{what} must be a finite number of seconds >= 0, got {value!r}")


@declare("answer", {"rid": int, "ok": bool, "value": wire.ANY})
class Answer:
    """The answer to request ``rid``: ``value``, or with ``ok`` False the error as [kind, message]."""

    rid: int
    ok: bool
    value: Any


# -- a client's requests to an island host -------------------------------------------------------------------

@declare("batch", {"rid": int, "first": int, "msgs": ("list", bytes)})
class Batch:
    """Messages ``first``, ``first + 1``, ... of the client's stream to the island (``call``, ``put`` and
    ``free`` of ``pathways.messages``): only host 0 takes them; each is admitted or refused alone. The answer
    says the island has taken them (the client sends more while it waits for at most a few answers)."""

    rid: int
    first: int
    msgs: list

    def check(self) -> None:
        """A batch numbers its messages from 0 up and holds at least one."""
        if self.first < 0 or not self.msgs:
            raise WireFormatError("a batch holds at least one message, numbered from 0")


@declare("put_data", {"id": int, "shards": ("list", REGION), "dtype": str})
class PutData:
    """This host's shards of the value of put ``id`` (regions of the global array; their bytes follow the
    message back to back in C order). The put itself travels in the stream to host 0."""

    id: int
    shards: list
    dtype: str


@declare("fetch", {"rid": int, "id": int, "timeout": float, "ready_only": bool})
class Fetch:
    """This host's shards of buffer ``id`` once it exists (or only word that it is ready), waiting at most
    ``timeout`` seconds; the answer names the regions, and their bytes follow it."""

    rid: int
    id: int
    timeout: float
    ready_only: bool

    def check(self) -> None:
        """The timeout is a finite number of seconds."""
        _finite(self.timeout, "fetch.timeout")


@declare("stalled", {"rid": int})
class Stalled:
    """What the client's tenant's unfinished fragments on this host wait for (a timed-out fetch says it)."""

    rid: int


@declare("usage", {"rid": int, "reset_peak": bool})
class Usage:
    """The tenant's buffers, bytes and peak bytes on this host (``reset_peak``: the peak starts again now)."""

    rid: int
    reset_peak: bool


@declare("trace_start", {"rid": int})
class TraceStart:
    """Start recording this host's events for the client's ``pw.trace``."""

    rid: int


@declare("trace_stop", {"rid": int})
class TraceStop:
    """The client's trace: its tenant's events by name, everyone else's as anonymous spans."""

    rid: int


@declare("host_stats", {"rid": int})
class HostStats:
    """The host's counters, which name no tenant."""

    rid: int


@declare("schedule_stats", {"rid": int})
class ScheduleStats:
    """The island's share of time: the client's tenant by name, the others as one sum (host 0)."""

    rid: int


@declare("ping", {"rid": int})
class Ping:
    """The host's wall clock (a round trip's midpoint gives the clock offset ``pw.trace`` corrects)."""

    rid: int


@declare("position", {"rid": int})
class Position:
    """The number of the next message of the client's stream that the island takes (host 0): where a client
    that was attached when the cluster was suspended sends from once it resumes."""

    rid: int


HOST_REQUESTS = (Batch, PutData, Fetch, Stalled, Usage, TraceStart, TraceStop, HostStats, ScheduleStats, Ping,
                 Position)


# -- requests to the resource manager ------------------------------------------------------------------------

@declare("ready", {"rid": int})
class Ready:
    """The runtime's topology and identity (anonymous): what a client checks before opening a session."""

    rid: int


@declare("open", {"rid": int, "tenant": str, "credential": ("opt", str), "ticket": ("opt", str), "pid": int,
                  "job": ("opt", str)})
class Open:
    """A new session for the tenant a credential (or a job's ticket) proves; on an anonymous connection, which
    the answer upgrades to the new session's key."""

    rid: int
    tenant: str
    credential: str | None
    ticket: str | None
    pid: int
    job: str | None


@declare("renew", {"rid": int})
class Renew:
    """Keep the session alive; the answer has each island's epoch and, for islands that restarted, their new
    hosts' addresses."""

    rid: int


@declare("watch", {"rid": int, "seen": int})
class Watch:
    """Answered when the cluster's state is no longer generation ``seen`` (at once if it is not): its state
    (``running``, ``suspending``, ``suspended``, ``resuming``), generation and islands. A connection has one
    watch at a time; a new one answers the old."""

    rid: int
    seen: int


@declare("quiesced", {"rid": int, "generation": int})
class Quiesced:
    """The client has stopped sending for the suspend of ``generation``: everything it sent was taken."""

    rid: int
    generation: int


@declare("allocate", {"rid": int, "shape": ("list", int), "axes": ("list", str), "island": ("opt", int)})
class Allocate:
    """A virtual slice of ``shape`` over ``axes`` (on ``island``, or where the resource manager places it)."""

    rid: int
    shape: list
    axes: list
    island: int | None


@declare("release", {"rid": int, "slice": str})
class Release:
    """Free slice ``slice`` of the client's tenant."""

    rid: int
    slice: str


@declare("close", {"rid": int})
class Close:
    """End the session: its slices are released and its buffers freed."""

    rid: int


@declare("state", {"rid": int})
class State:
    """The cluster as the client's tenant may see it."""

    rid: int


@declare("suspect", {"rid": int, "island": int, "reason": str})
class Suspect:
    """The client saw ``island`` fail: the resource manager checks it now instead of at its next round."""

    rid: int
    island: int
    reason: str


@declare("whoami", {"rid": int, "tenant": str, "credential": str})
class WhoAmI:
    """Whether a credential is the admin's or ``tenant``'s (anonymous; what the command checks before acting)."""

    rid: int
    tenant: str
    credential: str


@declare("admin", {"rid": int, "credential": str, "op": str, "args": ("map", wire.ANY)})
class AdminOp:
    """One of the cluster admin's operations (``op``, with ``args``), proven by the admin credential."""

    rid: int
    credential: str
    op: str
    args: dict


@declare("submit_job", {"rid": int, "tenant": str, "credential": str, "entrypoint": ("list", str),
                        "name": ("opt", str)})
class SubmitJob:
    """Run ``entrypoint`` as a job of ``tenant``, in the working directory whose tar archive follows the
    message; the job's process holds a single-use ticket and the runtime's address, nothing else."""

    rid: int
    tenant: str
    credential: str
    entrypoint: list
    name: str | None

    def check(self) -> None:
        """An entrypoint is a non-empty list of arguments."""
        if not self.entrypoint or not all(self.entrypoint):
            raise WireFormatError("a job's entrypoint is a non-empty command, e.g. ['python', 'train.py']")


@declare("jobs", {"rid": int, "tenant": str, "credential": str})
class ListJobs:
    """The jobs the credential may see: the tenant's own, or every job for the admin."""

    rid: int
    tenant: str
    credential: str


@declare("job_logs", {"rid": int, "tenant": str, "credential": str, "job": str, "offset": int})
class JobLogs:
    """A job's log from byte ``offset`` on (at most ``MAX_LOG_CHUNK`` bytes), and whether the job has ended."""

    rid: int
    tenant: str
    credential: str
    job: str
    offset: int

    MAX_LOG_CHUNK: ClassVar[int] = 1 << 20


@declare("stop_job", {"rid": int, "tenant": str, "credential": str, "job": str})
class StopJob:
    """Stop a job the credential may act on; the answer is its final status."""

    rid: int
    tenant: str
    credential: str
    job: str


ANONYMOUS_REQUESTS = (Ready, Open, WhoAmI, AdminOp, SubmitJob, ListJobs, JobLogs, StopJob)
SESSION_REQUESTS = (Renew, Allocate, Release, Close, State, Suspect, Watch, Quiesced)
