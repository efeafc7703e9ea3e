"""``pathways down`` (``command.down``) without Ray: what it stops and what it leaves, by what ``pathways up``
recorded. The runtime's launcher (a Ray driver in a process of its own) is replaced by a recorder; the head
``up`` started is a real process in a session of its own, named by its temp dir as a Ray head is."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.runtime import current_file, home
from command import down, head, secrets
from command.down import cmd_down
from command.output import CliError

ADDRESS = "pathways://127.0.0.1:47001"
RAY_ADDRESS = "127.0.0.1:46379"


class Launcher:
    """Stands in for ``command.launcher.launch``: records each call, answers or fails as told."""

    def __init__(self, fails: str | None = None) -> None:
        self.calls: list[tuple[str, dict, float]] = []
        self.fails = fails

    def __call__(self, mode: str, options: dict, timeout: float) -> dict:
        self.calls.append((mode, options, timeout))
        if self.fails:
            raise CliError(self.fails)
        return {"ok": True}


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A private PATHWAYS_HOME and PATHWAYS_TMPDIR, and a recording launcher."""
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATHWAYS_TMPDIR", str(tmp_path / "tmp"))
    launcher = Launcher()
    monkeypatch.setattr(down, "launch", launcher)
    return launcher


@pytest.fixture
def ray_head(tmp_path):
    """A process standing for the Ray head ``up`` started: its own process group, its temp dir on its command
    line."""
    temp_dir = tmp_path / "ray-head"
    temp_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(temp_dir)],
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while str(temp_dir) not in Path(f"/proc/{proc.pid}/cmdline").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)  # exec has not happened yet: wait for the new command line (bounded)
    yield proc, str(temp_dir)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def args(timeout: float = 30.0, admin_credential_file: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(timeout=timeout, admin_credential_file=admin_credential_file)


def record(head_pid: int | None, temp_dir: str | None = None, phase: str = "up") -> None:
    head.save_state(head.ClusterState(ADDRESS, RAY_ADDRESS, head_pid, temp_dir, {"islands": 2}, time.time(), phase))


def test_with_nothing_recorded_there_is_nothing_to_stop(machine, capsys):
    assert cmd_down(args()) == 0
    out = capsys.readouterr().out
    assert "nothing to stop" in out and str(head.state_path()) in out
    assert machine.calls == []


def test_an_interrupted_up_that_started_nothing_is_forgotten(machine, capsys):
    record(None, phase="starting")
    assert cmd_down(args()) == 0
    assert "forgot an interrupted `pathways up` that had started nothing" in capsys.readouterr().out
    assert head.load_state() is None and machine.calls == []  # no runtime to stop: no credential asked for


def test_an_interrupted_up_has_its_head_stopped(machine, ray_head, capsys):
    proc, temp_dir = ray_head
    record(proc.pid, temp_dir, phase="starting")
    assert cmd_down(args()) == 0
    assert proc.wait(timeout=30) is not None and not Path(temp_dir).exists()
    assert f"stopped what an interrupted `pathways up` left (the Ray head, pid {proc.pid}" in capsys.readouterr().out
    assert head.load_state() is None and machine.calls == []


def test_a_runtime_on_a_joined_cluster_needs_the_admin_credential_and_is_kept_recorded_without_it(machine):
    record(None)
    with pytest.raises(CliError, match="`pathways down` needs the cluster's admin credential: .*admin.token does "
                                       "not exist.*--admin-credential-file"):
        cmd_down(args())
    assert head.load_state() is not None and machine.calls == []  # nothing was stopped: `down` can be run again


def test_a_runtime_on_a_joined_cluster_is_stopped_and_the_cluster_left_running(machine, capsys):
    secrets.write_secret(secrets.admin_path(), "the-admin-secret")
    head.publish(ADDRESS)
    record(None)
    assert cmd_down(args(timeout=12.0)) == 0
    assert machine.calls == [("down", {"ray_address": RAY_ADDRESS, "admin_credential": "the-admin-secret"}, 72.0)]
    out = capsys.readouterr().out
    assert "stopped the runtime's jobs and removed the resource manager and its islands" in out
    assert f"left the Ray cluster at {RAY_ADDRESS} running" in out
    assert head.load_state() is None and not current_file().exists()  # no client is sent to it any more


def test_the_address_another_runtime_published_stays(machine, capsys):
    secrets.write_secret(secrets.admin_path(), "s")
    head.publish("pathways://127.0.0.1:48000")  # a later `up` of another home published its own
    record(None)
    assert cmd_down(args()) == 0
    assert current_file().read_text().strip() == "pathways://127.0.0.1:48000"


def test_a_runtime_on_a_joined_cluster_that_does_not_stop_is_an_error_and_stays_recorded(machine, monkeypatch):
    secrets.write_secret(secrets.admin_path(), "s")
    monkeypatch.setattr(down, "launch", Launcher(fails="the runtime did not answer `down` within 90s"))
    record(None)
    with pytest.raises(CliError, match="did not answer `down` within 90s"):
        cmd_down(args())
    assert head.load_state() is not None


def test_the_head_up_started_is_stopped_even_when_the_runtime_does_not_stop_cleanly(machine, ray_head, monkeypatch,
                                                                                     capsys, tmp_path):
    proc, temp_dir = ray_head
    credential_file = tmp_path / "admin"
    credential_file.write_text("from-a-file\n")
    failing = Launcher(fails="no resource manager")
    monkeypatch.setattr(down, "launch", failing)
    record(proc.pid, temp_dir)
    assert cmd_down(args(admin_credential_file=str(credential_file))) == 0
    assert failing.calls[0][1]["admin_credential"] == "from-a-file"
    assert proc.wait(timeout=30) is not None and not Path(temp_dir).exists()  # the head is gone, its files too
    out = capsys.readouterr().out
    assert "the runtime did not stop cleanly (no resource manager); stopping its Ray head" in out
    assert "stopped the Ray head that `pathways up` started" in out
    assert head.load_state() is None


def test_a_head_that_already_died_is_swept_without_asking_for_the_credential(machine, ray_head, capsys):
    proc, temp_dir = ray_head
    proc.kill()
    proc.wait(timeout=30)
    record(proc.pid, temp_dir)
    assert cmd_down(args()) == 0  # no admin credential here, and none needed: there is no runtime to reach
    assert machine.calls == [] and not Path(temp_dir).exists()
    assert "stopped the Ray head that `pathways up` started" in capsys.readouterr().out
    assert head.load_state() is None


def test_the_tenant_registry_outlives_down(machine, capsys):
    secrets.write_secret(secrets.admin_path(), "s")
    registry = home() / "registry.json"
    registry.write_text("{}")
    record(None)
    assert cmd_down(args()) == 0
    assert registry.exists()
    assert f"the tenant registry stays in {registry}: the next `pathways up` keeps its tenants" in (
        capsys.readouterr().out)


def test_an_unreadable_state_file_says_how_to_recover(machine):
    head.state_path().parent.mkdir(parents=True)
    head.state_path().write_text("{not json")
    with pytest.raises(CliError, match="is unreadable .*; delete it and retry"):
        cmd_down(args())
