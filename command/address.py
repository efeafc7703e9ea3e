"""Where the runtime is, for every command that talks to it."""

from __future__ import annotations

import os

from client.runtime import load_login, machine_runtime
from command import head
from command.output import CliError
from pathways.errors import PathwaysError
from pathways.names import ADDRESS_ENV


def resolve_address(arg: str | None) -> str:
    """``--address``, else ``PATHWAYS_ADDRESS``, else the saved login's, else the cluster ``pathways up``
    recorded or started on this machine; CliError saying how to get one otherwise."""
    if arg or os.environ.get(ADDRESS_ENV):
        return arg or os.environ[ADDRESS_ENV]
    try:
        saved = load_login()
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    if saved is not None:
        return saved.address
    state = head.load_state()
    if state is not None and state.address:
        return state.address
    running = machine_runtime()
    if running is not None:
        return running
    raise CliError("no cluster: pass --address pathways://HOST:PORT, set PATHWAYS_ADDRESS, run `pathways login` "
                   "with what your admin gave you, or start one here with `pathways up`")
