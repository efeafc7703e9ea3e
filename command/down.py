"""``pathways down``: stop the runtime ``pathways up`` started on this machine, its jobs, and the Ray head if ``up``
started it (also what an interrupted ``up`` left)."""

from __future__ import annotations

import argparse

from client.runtime import home
from command import head, secrets
from command.launcher import launch
from command.output import CliError, say


def cmd_down(args: argparse.Namespace) -> int:
    """``pathways down``: stop the runtime's jobs and actors, and the Ray head if ``pathways up`` started it."""
    state = head.load_state()
    if state is None:
        say(f"nothing to stop: no cluster that `pathways up` started is recorded in {head.state_path()} (a cluster "
            "started elsewhere is stopped where it was started)")
        return 0
    if state.phase == "starting":
        took = head.stop_head(state.head_pid, state.temp_dir) if state.head_pid else 0.0
        head.clear_state()
        print(f"stopped what an interrupted `pathways up` left (the Ray head, pid {state.head_pid}, {took:.1f}s)"
              if state.head_pid else "forgot an interrupted `pathways up` that had started nothing")
        return 0
    alive = head.head_alive(state) or not state.owns_head
    if alive:
        credential = secrets.need_admin_credential(args.admin_credential_file, "`pathways down`")
        try:
            launch("down", {"ray_address": state.ray_address, "admin_credential": credential}, args.timeout + 60)
            print("stopped the runtime's jobs and removed the resource manager and its islands")
        except CliError as exc:
            if not state.owns_head:
                raise
            print(f"the runtime did not stop cleanly ({exc}); stopping its Ray head")
    if state.owns_head:
        took = head.stop_head(state.head_pid, state.temp_dir)
        print(f"stopped the Ray head that `pathways up` started ({took:.1f}s)")
    else:
        print(f"left the Ray cluster at {state.ray_address} running: `pathways up` did not start it")
    head.unpublish(state.address)
    head.clear_state()
    registry = home() / "registry.json"
    if registry.exists():
        print(f"the tenant registry stays in {registry}: the next `pathways up` keeps its tenants")
    return 0
