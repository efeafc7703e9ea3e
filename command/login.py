"""``pathways login`` and ``logout``: a tenant's own machine remembers the runtime's address, the tenant and its
credential (checked against the runtime first), for the command and for a bare ``pw.init()``."""

from __future__ import annotations

import argparse

from client.link import Link, expect_role
from client.runtime import Login, login_path, save_login
from command import secrets
from command.output import CliError
from pathways.errors import PathwaysError
from pathways.requests import WhoAmI


def cmd_login(args: argparse.Namespace) -> int:
    """``pathways login``: check the credential against the runtime, then save address, tenant and credential."""
    secrets.check_tenant(args.tenant)
    credential = args.credential or secrets.read_secret(args.credential_file)
    if not credential:
        raise CliError(f"--credential-file {args.credential_file}: no such file (or it is empty)")
    try:
        link = Link(args.login_address, 0, None, expect_role(None, "rm"), "the resource manager")
        who = link.call(lambda rid: WhoAmI(rid, args.tenant, credential), 30)
        link.close()
    except PathwaysError as exc:
        raise CliError(f"login to {args.login_address} as {args.tenant} failed: {exc}") from None
    if who.get("tenant") != args.tenant:
        raise CliError("that is the admin credential; log in with a tenant's credential (`pathways tenants add`)")
    path = save_login(Login(args.login_address, args.tenant, credential))
    print(f"logged in to {args.login_address} as {args.tenant}; saved in {path} (readable by you only).\n"
          f"  pw.init() and `pathways status | submit | jobs | logs | stop` use it from now on.")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    """``pathways logout``: forget the saved login."""
    path = login_path()
    if path.exists():
        path.unlink()
        print(f"forgot the login in {path}")
    else:
        print("not logged in")
    return 0
