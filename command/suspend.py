"""``pathways suspend`` and ``pathways resume``: save every tenant's arrays, sessions and executables into a
directory and stop the islands; restore them there or on a new cluster of the same topology."""

from __future__ import annotations

import argparse
import math
import os

from command import secrets
from command.address import resolve_address
from command.output import CliError, say
from pathways.errors import PathwaysError


def location(directory: str | None) -> str | None:
    """A suspend directory as the runtime on this machine reads it: absolute, or an fsspec URL as given."""
    if not directory or "://" in directory:
        return directory
    return os.path.abspath(os.path.expanduser(directory))


def _suspend_or_resume(args: argparse.Namespace, op: str) -> dict:
    from client.admin import Admin

    if not (math.isfinite(args.timeout) and 0 < args.timeout <= 86400):
        raise CliError(f"--timeout must be a number of seconds between 0 and 86400, got {args.timeout}")
    credential = secrets.need_admin_credential(args.admin_credential_file, f"`pathways {op}`")
    try:
        admin = Admin.connect(resolve_address(args.address), credential)
        return getattr(admin, op)(location(args.dir), args.timeout)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def cmd_suspend(args: argparse.Namespace) -> int:
    """``pathways suspend``: save the cluster into a directory and stop its islands."""
    done = _suspend_or_resume(args, "suspend")
    say(f"suspended into {done['suspended']} in {done['seconds']:.1f}s: {done['buffers']} buffers "
        f"({done['bytes'] / 2**30:.3f} GiB) of {done['sessions']} sessions. The islands are stopped; attached "
        f"clients wait. Resume with `pathways resume` (here, or after `pathways down` and `pathways up` with the same "
        f"topology: `pathways resume {done['suspended']}`)")
    if done.get("clients_silent"):
        say(f"  clients {done['clients_silent']} did not say they stopped sending: messages they send meanwhile go "
            "after the resume")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """``pathways resume``: restore a suspended cluster from its directory."""
    done = _suspend_or_resume(args, "resume")
    dropped = done.get("sessions_dropped") or []
    say(f"resumed from {done['resumed']} in {done['seconds']:.1f}s: {done['buffers']} buffers "
        f"({done['bytes'] / 2**30:.3f} GiB) of {done['sessions']} sessions; attached clients go on"
        + (f". Left out {len(dropped)} sessions (closed meanwhile, or their tenant was removed)" if dropped else "")
        + (f". Left out {done['buffers_dropped']} buffers of sessions that ended meanwhile"
           if done.get("buffers_dropped") else ""))
    return 0
