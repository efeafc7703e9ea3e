"""Pipeline schedules as data (client/pipeline/schedules.py, order.py): each runs every piece of work once, in an
order the data allows; on the papers' cost model its idle fraction is its formula; the activations it holds
follow its bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import pathways as pw
from client.pipeline import order, schedules, timeline

CONFIGS = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1), ("interleaved", 4, 8, 2),
           ("interleaved", 2, 6, 3), ("interleaved", 4, 4, 2), ("zb-h1", 4, 8, 1), ("zb-h1", 3, 2, 1)]


def simulate(schedule: schedules.Schedule, t_f=1.0, t_b=1.0, t_w=1.0) -> float:
    """The idle fraction per device of ``schedule`` on the cost model (one device per island; B without W takes
    t_b + t_w)."""
    split = schedule.split_weights
    times = {"F": t_f, "B": t_b if split else t_b + t_w, "W": t_w}
    done = order.emission(schedule.name, schedule.order, order.chain_deps(schedule),
                          list(range(schedule.n_devices)), lambda w: times[w.kind])
    span = max(t.finish for t in done) - min(t.start for t in done)
    busy = sum(t.finish - t.start for t in done) / schedule.n_devices
    return 1 - busy / span


@pytest.mark.parametrize("name,p,m,v", CONFIGS)
def test_every_work_runs_once_on_its_device_in_data_order(name, p, m, v):
    s = pw.pipeline.make(name, p, m, v)
    kinds = ("F", "B", "W") if name == "zb-h1" else ("F", "B")
    seen = [w for seq in s.order for w in seq]
    assert sorted(seen, key=repr) == sorted([schedules.Work(k, st, i) for k in kinds for st in range(p * v)
                                             for i in range(m)], key=repr)
    for d, seq in enumerate(s.order):
        assert all(s.device_of(w.stage) == d for w in seq)
        pos = {w: k for k, w in enumerate(seq)}
        for w in seq:  # a micro-batch's F before its B before its W, on each stage
            if w.kind != "F":
                assert pos[schedules.Work("F", w.stage, w.micro)] < pos[w]
            if w.kind == "W":
                assert pos[schedules.Work("B", w.stage, w.micro)] < pos[w]


@pytest.mark.parametrize("name,p,m,v", [c for c in CONFIGS if c[2] >= c[1]])  # ZB-H1's formula needs m >= p
def test_idle_fraction_on_the_cost_model_is_the_formula(name, p, m, v):
    s = pw.pipeline.make(name, p, m, v)
    assert simulate(s) == pytest.approx(s.bubble(), abs=1e-9)
    if name == "zb-h1":  # the formula's dependence on the three times holds too, a W longer than F or B included
        for times in [(1.0, 1.5, 0.5), (1.0, 1.0, 1.2), (0.8, 1.0, 1.0), (1.0, 0.8, 1.0), (1.3, 1.0, 1.2)]:
            assert simulate(s, *times) == pytest.approx(s.bubble(*times), abs=1e-9), times


def test_formulas_cut_the_bubble_as_the_papers_say():
    one = pw.pipeline.bubble("1f1b", 4, 8)
    assert one == pytest.approx(3 / 11) and pw.pipeline.bubble("gpipe", 4, 8) == one
    assert pw.pipeline.bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(vm) of the ideal time
    zb = pw.pipeline.bubble("zb-h1", 4, 8)
    # ZB-H1's idle time is a third of 1F1B's when F, B and W take the same time
    assert zb / (1 - zb) == pytest.approx(one / (1 - one) / 3)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (3, 3)])
def test_in_flight_bounds(p, m):
    assert [pw.pipeline.make("gpipe", p, m).in_flight(d) for d in range(p)] == [m] * p
    assert [pw.pipeline.make("1f1b", p, m).in_flight(d) for d in range(p)] == [min(p - d, m) for d in range(p)]
    assert max(pw.pipeline.make("zb-h1", p, m).in_flight(d) for d in range(p)) <= p
    if m % p == 0:
        inter = pw.pipeline.make("interleaved", p, m, 2)
        # Megatron's warm-up: device d holds 2(p-d-1) + (v-1)p + 1 chunk-micro-batches at most
        want = [2 * m if m == p else min(2 * (p - d - 1) + p + 1, 2 * m) for d in range(p)]  # m = p: all warm-up
        assert [inter.in_flight(d) for d in range(p)] == want


def test_zb_h1_defers_weight_passes_into_the_drain():
    s = pw.pipeline.make("zb-h1", 4, 8)
    last = s.order[3]
    assert [w.kind for w in last[:6]] == ["F", "B"] * 3  # the last device defers its first p-1 W
    assert [w.kind for w in last[-3:]] == ["W"] * 3
    assert [w.kind for w in s.order[0][:3]] == ["F"] * 3  # the first device warms up as in 1F1B


def test_emission_refuses_an_order_the_data_contradicts():
    s = pw.pipeline.make("1f1b", 2, 2)
    backwards = schedules.Schedule("1f1b", 2, 1, 2, (tuple(reversed(s.order[0])), s.order[1]))
    with pytest.raises(pw.ProgramError, match="deadlocks"):
        order.emission("1f1b", backwards.order, order.chain_deps(backwards), [0, 1], lambda w: 1.0)


def test_bad_schedules_raise_clear_errors():
    with pytest.raises(pw.ProgramError, match="unknown pipeline schedule 'eager'"):
        pw.pipeline.make("eager", 2, 4)
    with pytest.raises(pw.ProgramError, match="n_micro must be a positive int"):
        pw.pipeline.make("1f1b", 2, 0)
    with pytest.raises(pw.ProgramError, match="must be a multiple of the number of slices"):
        pw.pipeline.make("interleaved", 4, 6, 2)
    with pytest.raises(pw.ProgramError, match="runs one stage per slice, but the step marks 8 stages for 4"):
        pw.pipeline.make("1f1b", 4, 8, 2)


def chrome_trace(schedule: schedules.Schedule, steps: int, lanes: list[timeline.Lane], times: dict,
                 hosts: int = 1) -> dict:
    """What pw.trace writes for ``steps`` steps run exactly on the cost model: one exec span per piece of work
    and host of its slice, naming the slice, other ops (a receive) between them. Each island runs a step as
    one fragment in parts: every span has a place (``seq``) of its own and names its step's fragment.
    ``lanes`` lists every replica's devices; replica r runs the schedule on lanes r*p..r*p+p-1."""
    p = schedule.n_devices
    order_of = [schedule.order[k % p] for k in range(len(lanes))]

    def deps(lane, w):
        return [(lane - lane % p + d, b) for d, b in order.chain_deps(schedule)(lane, w)]

    done = order.emission(schedule.name, order_of, deps, [lane.island for lane in lanes], lambda w: times[w.kind])
    span = max(t.finish for t in done)
    events = []
    for step in range(steps):
        base = step * (span + 5.0)
        for k, t in enumerate(done):
            lane = lanes[t.lane]
            place = {"seq": 1000 * step + k, "fragment": 10 + step}
            for host in range(hosts):
                events.append({"ph": "X", "cat": "exec", "pid": 100 + lane.island, "tid": host,
                               "name": f"stage{t.work.stage}.{t.work.kind}", "ts": (base + t.start) * 1e6,
                               "dur": (t.finish - t.start) * 1e6, "args": {**place, "slice": lane.slice}})
            events.append({"ph": "X", "cat": "recv", "pid": 100 + lane.island, "tid": 0, "name": "recv",
                           "ts": (base + t.start) * 1e6, "dur": 1.0, "args": place})
    return {"traceEvents": events}


def pipeline_lanes(replicas: int, p: int, n_stages: int, islands: int) -> list[timeline.Lane]:
    """The lanes of ``replicas`` pipelines of p slices each, slice d of every replica on island d mod islands."""
    made = [[SimpleNamespace(island=d % islands, key=f"r{r}d{d}") for d in range(p)] for r in range(replicas)]
    return timeline.lanes_of(made, n_stages)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 8, 1)])
def test_the_bubble_read_off_timelines_is_the_formula_on_the_cost_model(name, p, m, v):
    s = pw.pipeline.make(name, p, m, v)
    times = {"F": 1.0, "B": 1.0 if name == "zb-h1" else 2.0, "W": 1.0}
    lanes = pipeline_lanes(1, p, p * v, p)  # slice k on island k
    measured = timeline.measure(chrome_trace(s, 2, lanes, times), lanes)
    assert measured.steps == 2 and measured.bubble == pytest.approx(s.bubble(), abs=1e-9)
    assert measured.times_s["F"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no complete step"):
        timeline.measure({"traceEvents": []}, lanes)


def test_replicas_sharing_islands_and_slices_over_several_hosts_keep_their_lanes():
    """Two replicas of a 2-device pipeline whose slices share the same two islands (each island then runs two
    devices' work, one after the other), their slices spanning two hosts: every device's busy time is its own
    spans', counted once."""
    s = pw.pipeline.make("1f1b", 2, 4)
    lanes = pipeline_lanes(2, 2, 2, 2)
    measured = timeline.measure(chrome_trace(s, 1, lanes, {"F": 1.0, "B": 2.0}, hosts=2), lanes)
    # each device computes 4 x (1 + 2) = 12 of the window; both replicas' devices alike
    window = measured.window_s
    assert [round((1 - b) * window, 9) for b in measured.per_device] == [12.0] * 4
    assert measured.per_device[0] == pytest.approx(measured.per_device[2])


def test_a_devices_own_sends_and_receives_are_moving_not_waiting():
    """A device with its island to itself: its island's sends and receives of the step are time spent moving
    data, reported apart from the bubble; devices sharing an island cannot tell theirs apart (they wait)."""
    def span(island, cat, name, start, end, **args):
        return {"ph": "X", "cat": cat, "pid": 100 + island, "tid": 0, "name": name, "ts": start * 1e6,
                "dur": (end - start) * 1e6, "args": {"fragment": 5 + island, **args}}

    def trace(island_b):
        return {"traceEvents": [
            span(0, "exec", "stage0.F", 0.0, 1.0, slice="a"), span(0, "send", "send", 1.0, 1.5),
            span(island_b, "recv", "recv", 1.5, 2.0), span(island_b, "exec", "stage1.F", 2.0, 3.0, slice="b"),
            span(0, "exec", "stage0.B", 3.0, 4.0, slice="a"), span(0, "recv", "recv", 4.0, 9.0)]}  # after: clipped

    own = timeline.measure(trace(1), [timeline.Lane(0, "a", (0,)), timeline.Lane(1, "b", (1,))])
    assert own.window_s == pytest.approx(4.0)
    assert own.per_device == pytest.approx((1 - 2.5 / 4, 1 - 1.5 / 4))
    assert own.moving == pytest.approx(0.5 / 4) and own.bubble == pytest.approx(0.5)
    shared = timeline.measure(trace(0), [timeline.Lane(0, "a", (0,)), timeline.Lane(0, "b", (1,))])
    assert shared.per_device == pytest.approx((1 - 2 / 4, 1 - 1 / 4)) and shared.moving == 0.0
