"""What a user reads when a call cannot go on: an array used after pw.shutdown(), a function on a released
slice, a shape error inside a program, a Python scalar that changes on every call. Each message says what
happened, where (the user's line, the slice) and what to do, in the user's terms."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from conftest import tenant_env

import pathways as pw
from client import program as program_module

pytestmark = pytest.mark.cluster


def line_of(fn, text: str) -> str:
    """'file:line: code' of the line of ``fn``'s source that holds ``text``, as the runtime names it."""
    lines, start = inspect.getsourcelines(fn)
    k = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + k}: {lines[k].strip()}"


def test_an_array_used_after_shutdown_says_to_fetch_before_and_a_fetched_one_stays_readable(cluster):
    script = textwrap.dedent("""
        import numpy as np, pathways as pw
        pw.init()  # address, tenant and credential from the environment
        s = pw.slice((1,), ("x",), island=0)
        lost = pw.put(np.arange(3, dtype=np.float32), s)
        kept = pw.put(np.arange(2, dtype=np.float32), s)
        np.asarray(kept)
        pw.shutdown()
        print("kept", np.asarray(kept).tolist())
        try:
            np.asarray(lost)
        except pw.PathwaysError as exc:
            print("error", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=tenant_env("late"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert out["kept"] == "[0.0, 1.0]"
    assert out["error"] == (
        "fetching a pw.Array float32[3] after pw.shutdown(): its buffers were freed with the session that made it "
        "(arrays do not outlive their session). Fetch what you need before pw.shutdown() (np.asarray(x), "
        "jax.device_get(tree)); a value fetched before stays readable, and pw.put copies it into a new session")


def test_a_function_on_a_released_slice_says_so_and_how_to_go_on(cluster):
    s = pw.slice((1,), ("x",), island=0)
    inc = pw.jit(lambda v: v + 1.0, slice=s, name="inc")
    made = inc(np.ones(2, np.float32))  # traced and run while the slice lived
    never_called = pw.jit(lambda v: v * 2.0, slice=s, name="double")
    pw.release(s)
    for fn in (inc, never_called):
        with pytest.raises(pw.ProgramError) as info:
            fn(np.ones(2, np.float32))  # a numpy argument: no pw.Array of the user's is involved
        assert str(info.value) == (
            f"{fn.name} runs on slice {s.key} (island 0), which was released: nothing runs on a released slice "
            "(arrays made there stay fetchable until dropped). Allocate a new slice and create the function on it: "
            "pw.jit(fn, slice=pw.slice(...)), or f.on(new_slice)")
    np.testing.assert_array_equal(np.asarray(made), [2.0, 2.0])  # as pw.release's docstring says
    with pytest.raises(pw.ProgramError) as info:
        inc(made)
    assert str(info.value).startswith(f"inc got a pw.Array float32[2] on slice {s.key}, which was released: "
                                      "nothing runs on a released slice. The array stays fetchable")
    with pw.slice((1,), ("x",), island=0) as fresh:
        np.testing.assert_array_equal(np.asarray(inc.on(fresh)(np.asarray(made))), [3.0, 3.0])

        @pw.program
        def twice(v):
            return pw.jit(lambda a: a * 2.0, slice=fresh, name="times2")(inc(v))

        with pytest.raises(pw.ProgramError, match=rf"@pw.program twice runs inc on slice {s.key} \(island 0\), "
                                                  "which was released"):
            twice(np.ones(2, np.float32))


def test_calls_made_right_before_a_release_run_and_stay_fetchable(cluster):
    """The release goes by the resource manager, the calls by the client's stream to the island: a release
    must not overtake the calls made before it, whose arrays stay fetchable (a busy machine showed it did)."""
    s = pw.slice((1,), ("x",), island=0)
    step = pw.jit(lambda v: v * 2.0, slice=s, name="step")
    outs = [step(np.full(2, k, np.float32)) for k in range(300)]
    pw.release(s)
    assert [float(np.asarray(out)[0]) for out in outs] == [2.0 * k for k in range(300)]


def test_a_shape_error_inside_a_program_names_the_users_line(cluster):
    with pw.slice((1,), ("x",), island=0) as s:
        mm = pw.jit(lambda a, b: a @ b, slice=s, name="mm")

        @pw.program
        def step(a, b):
            return mm(a, b)  # (2, 3) @ (2, 3): the shapes do not fit

        a = pw.put(np.ones((2, 3), np.float32), s)
        with pytest.raises(pw.ProgramError) as info:
            step(a, a)
        message = str(info.value)
        assert message.startswith("mm cannot run on arguments (float32[2, 3], float32[2, 3]): TypeError: ")
        assert message.endswith(f", at {line_of(step.fn, 'return mm(a, b)')}"), message


def test_a_changing_python_scalar_warns_once_with_the_fix_and_the_trace_cache_is_bounded(cluster):
    with pw.slice((1,), ("x",), island=0) as s:
        scale = pw.jit(lambda v, k: v * k, slice=s, name="scale")

        @pw.program
        def step(v, k):
            return scale(v, k)

        x = pw.put(np.ones(2, np.float32), s)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [step(x, 0.5 * i) for i in range(6)]  # noqa: F841 - the line the warning names
        mine = [w for w in caught if "@pw.program step" in str(w.message)]
        assert len(mine) == 1, [str(w.message) for w in caught]
        assert str(mine[0].message) == (
            "@pw.program step was traced again for each new value of its Python float argument k (0.0, 0.5, 1.0): "
            "Python scalars are static in a program, so each new value traces and lowers the whole program again. "
            "Pass it as a value instead, e.g. np.float32(k), which is sent with each call and traced once; keep a "
            "Python scalar only where the body's Python control flow depends on it")
        assert mine[0].category is UserWarning and mine[0].filename == __file__  # points at the user's call
        np.testing.assert_array_equal(np.asarray(outs[-1]), [2.5, 2.5])

        traces = len(step._cache)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the fix: no retrace, no warning
            values = [np.asarray(step(x, np.float32(0.25 * i))) for i in range(4)]
        assert len(step._cache) == traces + 1
        np.testing.assert_array_equal(values[-1], [0.75, 0.75])

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(program_module.TRACE_CACHE_SIZE + 10):
                step.graph(x, 100.0 + i)
        assert len(step._cache) == program_module.TRACE_CACHE_SIZE  # bounded: the oldest traces went first
