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
import tempfile
import textwrap

import pytest
from suite_paths import ROOT

# each test starts its own embedded cluster, in a process of its own (both at once)
pytestmark = [pytest.mark.cluster, pytest.mark.own_cluster]
FORK_WARNING = "os.fork() was called"


FLAX_EXAMPLE = ["-m", "examples.flax_port", "--steps", "3"]
JAX_THEN_INIT = ["-c", textwrap.dedent("""
    import jax.numpy as jnp
    import pathways as pw
    print(float(jnp.arange(4.0).sum()))  # plain JAX first: its threads run
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=1))
    pw.shutdown()
""")]


class Run:
    """``python ARGS`` from the repository root, started at once; its output goes to files (nobody reads a pipe
    meanwhile)."""

    def __init__(self, args: list[str]) -> None:
        keep = ("PATHWAYS_HOME", "PATHWAYS_TMPDIR")  # the suite's own: no address, tenant or credential
        env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_") or k in keep}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=self.out, stderr=self.err,
                                     text=True)

    def done(self) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.out.read(), self.err.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def runs():
    """Both processes, each with an embedded cluster of its own, run at once: what they print is what is checked."""
    started = {"flax": Run(FLAX_EXAMPLE), "jax_then_init": Run(JAX_THEN_INIT)}
    yield started
    for run in started.values():
        run.stop()


def test_the_flax_example_prints_its_result_and_no_fork_warning(runs):
    done = runs["flax"].done()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "largest relative difference over 3 steps" in done.stdout
    assert FORK_WARNING not in done.stderr, done.stderr[-3000:]


def test_pw_init_after_jax_computed_starts_its_cluster_without_a_fork_warning(runs):
    done = runs["jax_then_init"].done()
    assert done.returncode == 0, done.stderr[-3000:]
    assert FORK_WARNING not in done.stderr, done.stderr[-3000:]
