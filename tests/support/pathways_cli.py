"""Running the `pathways` command as a user does, in a process of its own: shared by the tests of the command and
of suspending a runtime that `pathways up` started."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

from command import head


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def lasting_ports(count: int) -> list[int]:
    """``count`` distinct ports free now, above Ray's worker ports (10002-19999) and below the kernel's ephemeral
    range, so that neither a Ray worker nor an outgoing connection of another process (the other worker's clusters)
    takes one while this home's runtime is down: its `up`s reuse them for the whole module, as a user's fixed ports
    (6379, 7100) are reused."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    for port in random.sample(range(20000, max(low, 21000)), 500):
        if head.port_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise AssertionError(f"fewer than {count} of 500 ports tried below {low} are free")


class Cli:
    """Runs `pathways ...` in a subprocess with a private home and tmpdir, and a PATH without this venv: the
    venv's python is called by its absolute path."""

    def __init__(self, home: Path, workdir: Path, tmpdir: Path) -> None:
        venv_bin = os.path.dirname(sys.executable)
        self.env = {k: v for k, v in os.environ.items() if k not in head.PRIVATE_ENV}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if p and os.path.abspath(p) != venv_bin) or "/usr/bin:/bin"
        self.env.update(PATHWAYS_HOME=str(home), PATHWAYS_TMPDIR=str(tmpdir))
        self.home, self.workdir = home, workdir
        self.command = [sys.executable, "-m", "command"]
        self.port, self.client_port = lasting_ports(2)
        self.topology = ["--islands", "1", "--hosts-per-island", "1", "--devices-per-host", "2"]

    def __call__(self, *args: str, timeout: float = 120.0, ok: bool = True,
                 env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.workdir, env={**self.env, **(env or {})})
        if ok:
            assert proc.returncode == 0, f"pathways {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def up(self, *extra: str, **kw) -> subprocess.CompletedProcess:
        """`pathways up` of this home. A busy machine can make Ray's raylet miss its 30 s registration, and `up` then
        starts the head again (three tries at most): the time allowed covers the three."""
        return self("up", "--port", str(self.port), "--client-port", str(self.client_port), *self.topology,
                    "--timeout", "240", *extra, timeout=330, **kw)

    def state(self, home: Path | None = None) -> dict | None:
        path = (home or self.home) / "cluster.json"
        return json.loads(path.read_text()) if path.exists() else None

    def credential(self, tenant: str) -> str:
        return (self.home / "credentials" / tenant).read_text().strip()

    def tenant_home(self, home: Path, added: str) -> dict:
        """Set up a tenant on "another machine" with what `pathways tenants add` printed (its login command);
        returns that home's environment."""
        login = next(line.split() for line in added.splitlines() if line.strip().startswith("pathways login"))
        env = {"PATHWAYS_HOME": str(home)}
        out = self(*login[1:], env=env).stdout
        assert "logged in to" in out and (home / "login.json").exists() and mode(home / "login.json") == 0o600
        return env


def head_processes(state: dict) -> list[int]:
    return head.processes_of(state["temp_dir"]) if state and state.get("temp_dir") else []


def stop_head_of(run: Cli) -> None:
    """Never leave a head behind, whatever a test did to it."""
    state = run.state()
    if state and state["head_pid"]:
        head.stop_head(state["head_pid"], state["temp_dir"])
