"""What a user's terminal shows besides their own output: no warning that reads as trouble where there is none.

JAX warns "os.fork() was called ... will likely lead to a deadlock" whenever a process in which JAX already
started its threads forks and runs Python in the child; subprocess.Popen does that only with a preexec_fn
(without one it uses vfork/posix_spawn and runs no Python in the child). Ray starts the daemons of an embedded
cluster with such a preexec_fn: a client never does (its embedded cluster runs in a child process of its own,
started without one, before which that child has run no JAX)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cluster  # each test starts its own embedded cluster, in a process of its own
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK_WARNING = "os.fork() was called"


def run(args: list[str]) -> subprocess.CompletedProcess:
    keep = ("PATHWAYS_HOME", "PATHWAYS_TMPDIR")  # the suite's own: no address, tenant or credential
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_") or k in keep}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_flax_example_prints_its_result_and_no_fork_warning():
    done = run(["-m", "examples.flax_port", "--steps", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "largest relative difference over 3 steps" in done.stdout
    assert FORK_WARNING not in done.stderr, done.stderr[-3000:]


def test_pw_init_after_jax_computed_starts_its_cluster_without_a_fork_warning():
    done = run(["-c", textwrap.dedent("""
        import jax.numpy as jnp
        import pathways as pw
        print(float(jnp.arange(4.0).sum()))  # plain JAX first: its threads run
        pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=1))
        pw.shutdown()
    """)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert FORK_WARNING not in done.stderr, done.stderr[-3000:]
