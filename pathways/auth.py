"""Secrets and message authentication: who may ask the runtime to do what.

Three kinds of secret, all 256-bit random:

- a tenant's **credential**, issued by the cluster's admin; the resource manager
  keeps only its SHA-256, and a client proves its tenant with it once, to open a
  session;
- a **session key**, made by the resource manager for one client and handed to
  that client and to the island hosts: every message of that client carries an
  HMAC over its bytes under this key, so no other process can send in its name,
  and the key itself never travels again;
- the **runtime key**, shared by the resource manager and its hosts only, which
  signs their messages to each other (orders, grants, deliveries).

``sign`` covers a purpose string and every part with its length, so a MAC for
one kind of request can never be replayed as another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

KEY_BYTES = 32


def new_secret() -> str:
    """A fresh credential or ticket: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(KEY_BYTES)


def new_key() -> bytes:
    """A fresh 256-bit key (a session key or the runtime key), as raw bytes."""
    return secrets.token_bytes(KEY_BYTES)


def digest(secret: str) -> str:
    """What the resource manager stores for a credential: its SHA-256 (the secret is 256 random bits)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_digest: str) -> bool:
    """Whether ``secret`` hashes to ``stored_digest``; compares in constant time."""
    return hmac.compare_digest(digest(secret), stored_digest)


def sign(key: bytes, purpose: str, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 under ``key`` of ``purpose`` and ``parts`` (each length-prefixed)."""
    mac = hmac.new(key, purpose.encode(), hashlib.sha256)
    for part in _encoded(parts):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, mac: bytes, purpose: str, *parts: bytes | str | int) -> bool:
    """Whether ``mac`` is ``sign(key, purpose, *parts)``; compares in constant time."""
    return isinstance(mac, bytes) and hmac.compare_digest(sign(key, purpose, *parts), mac)


def _encoded(parts: Iterable[bytes | str | int]) -> Iterable[bytes]:
    for part in parts:
        if isinstance(part, bytes):
            yield part
        elif isinstance(part, str):
            yield part.encode()
        elif isinstance(part, int) and not isinstance(part, bool):
            yield part.to_bytes(16, "little", signed=True)
        else:
            raise TypeError(f"cannot sign a {type(part).__name__}")
