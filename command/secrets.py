"""The secrets the ``pathways`` command keeps, each readable by its owner only, under ``$PATHWAYS_HOME``, and which
of them a command acts with (``identity``).

- ``admin.token``: the cluster admin's credential (``pathways up`` creates it);
- ``credentials/NAME``: a tenant's credential (``pathways tenants add`` writes it on the admin's machine);
- ``login.json``: the runtime a tenant uses, its name there and its credential (``pathways login``).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from client.admin import ADMIN_FILE
from client.runtime import Login, home, load_login
from command.output import CliError
from pathways.errors import PathwaysError
from pathways.names import CREDENTIAL_ENV

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name (1-63 letters, digits, '.', '_' or '-'); CliError otherwise."""
    if not TENANT_PATTERN.match(tenant):
        raise CliError(f"tenant {tenant!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter "
                       "or digit")
    return tenant


def write_secret(path: Path, secret: str) -> Path:
    """Write ``secret`` to ``path``, readable by its owner only (file 0600, folder 0700), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return path


def read_secret(path: Path | str) -> str | None:
    """The secret in ``path``; None if there is no such file; CliError if it is there but unreadable."""
    path = Path(path).expanduser()
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


def admin_path() -> Path:
    """Where the admin credential lives: ``$PATHWAYS_HOME/admin.token``."""
    return home() / ADMIN_FILE


def credential_path(tenant: str) -> Path:
    """Where a tenant's credential lives: ``$PATHWAYS_HOME/credentials/TENANT``; CliError for an invalid name."""
    return home() / "credentials" / check_tenant(tenant)  # a checked name never leaves that folder


def admin_credential(file: str | None = None) -> str | None:
    """The admin credential: from ``file`` (which must exist), else ``$PATHWAYS_HOME/admin.token``, else None."""
    if file:
        secret = read_secret(file)
        if secret is None:
            raise CliError(f"--admin-credential-file {file}: no such file (or it is empty)")
        return secret
    return read_secret(admin_path())


def need_admin_credential(file: str | None, what: str) -> str:
    """The admin credential (as ``admin_credential``), or CliError saying that ``what`` needs it."""
    secret = admin_credential(file)
    if secret is None:
        raise CliError(f"{what} needs the cluster's admin credential: {admin_path()} does not exist (`pathways up` "
                       "writes it for the admin who ran it); pass --admin-credential-file FILE")
    return secret


def ensure_admin_credential() -> tuple[str, bool]:
    """The admin credential of this ``$PATHWAYS_HOME``, created (owner-only) if there is none yet; and whether
    it was created now."""
    from pathways.auth import new_secret

    secret = read_secret(admin_path())
    if secret is not None:
        os.chmod(admin_path(), 0o600)  # whoever loosened it: readable by its owner only
        return secret, False
    secret = new_secret()
    write_secret(admin_path(), secret)
    return secret, True


def tenant_identity(tenant: str | None, file: str | None = None) -> tuple[str, str] | None:
    """(tenant, credential) to act as: ``--credential-file`` or PATHWAYS_CREDENTIAL or the tenant's credential
    file for an explicit tenant, else the saved login; None if there is none."""
    saved = _login()
    name = tenant or os.environ.get("PATHWAYS_TENANT") or (saved.tenant if saved else None)
    if name is None:
        return None
    check_tenant(name)
    if file:
        secret = read_secret(file)
        if secret is None:
            raise CliError(f"--credential-file {file}: no such file (or it is empty)")
        return name, secret
    if os.environ.get(CREDENTIAL_ENV):
        return name, os.environ[CREDENTIAL_ENV].strip()
    secret = read_secret(credential_path(name))
    if secret is None and saved is not None and saved.tenant == name:
        secret = saved.credential
    return (name, secret) if secret else None


def identity(args: argparse.Namespace, what: str) -> tuple[str, str, bool]:
    """(tenant, credential, is_admin) to act with: the admin credential unless a tenant was named, else the
    tenant's; CliError saying how to get one otherwise."""
    if not getattr(args, "tenant", None) and not getattr(args, "credential_file", None):
        admin = admin_credential(getattr(args, "admin_credential_file", None))
        if admin is not None:
            return "", admin, True
    found = tenant_identity(getattr(args, "tenant", None), getattr(args, "credential_file", None))
    if found is None:
        raise CliError(f"`pathways {what}` needs a tenant's credential (`pathways login ADDRESS --tenant NAME "
                       f"--credential ...`, or --tenant with --credential-file) or the admin's "
                       f"({admin_path()})")
    return found[0], found[1], False


def _login() -> Login | None:
    try:
        return load_login()
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
