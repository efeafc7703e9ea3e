"""A suspended cluster's directory: what the resource manager and the island hosts write there, and how.

``pathways suspend DIR`` fills one directory: each host writes its part (``host_part``: the bytes of its
arrays, uploads and executables in one data file, then an index of them), and the resource manager writes
``manifest.json`` last, naming every part with its size and checksum. A directory without a manifest holds
an unfinished suspend, which nothing resumes from. ``DIR`` is a local path (made private to the runtime's
user) or any fsspec URL (``s3://...``, ``gs://...``; needs the ``fsspec`` package and that filesystem's own).
"""

from __future__ import annotations

import json
import os
import stat
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pathways.errors import PathwaysError

FORMAT = 1  # the layout of a snapshot directory; resume refuses any other
MANIFEST = "manifest.json"
CHUNK = 64 << 20  # bytes read or written per call


def host_part(island: int, host: int) -> tuple[str, str]:
    """The names of host ``host`` of ``island``'s data file and index in the directory."""
    stem = f"island-{island}-host-{host}"
    return f"{stem}.bin", f"{stem}.json"


def stamped(root: str, when: float) -> str:
    """A new snapshot's directory under ``root`` (a runtime's ``--suspend-dir``), named by its UTC time so that
    names sort by age."""
    return f"{root.rstrip('/')}/{time.strftime('%Y%m%d-%H%M%S', time.gmtime(when))}"


def newest(root: str) -> str | None:
    """The newest finished snapshot (one with a manifest) directly under ``root``, or None."""
    store = Store(root)
    for name in sorted(store.children(), reverse=True):
        if Store(f"{store.location}/{name}").exists(MANIFEST):
            return f"{store.location}/{name}"
    return None


def checksum(data: Any, start: int = 0) -> int:
    """The CRC-32 of ``data`` (bytes-like), continuing from ``start``: what resume checks every byte against."""
    return zlib.crc32(data, start)


class Store:
    """One snapshot directory: a local path or an fsspec URL."""

    def __init__(self, location: str) -> None:
        if not isinstance(location, str) or not location.strip():
            raise PathwaysError("a snapshot directory is a path or an fsspec URL, e.g. /var/pathways/snapshot")
        self.location = location.rstrip("/") or "/"
        self.remote = "://" in location and not location.startswith("file://")
        self._fs: Any = None
        if "://" in location:
            try:
                import fsspec
            except ImportError:
                raise PathwaysError(f"{location} is an fsspec URL, and the fsspec package is not installed here: "
                                    "pip install fsspec (and the filesystem's own package, e.g. s3fs), or "
                                    "use a local directory") from None
            self._fs, self._root = fsspec.core.url_to_fs(location)
        else:
            self._root = str(Path(location).expanduser().absolute())

    def path(self, name: str) -> str:
        """Where file ``name`` of the snapshot lives."""
        return f"{self._root}/{name}"

    def prepare(self) -> None:
        """Make the directory for a new snapshot: private to this user (0700) when local. Refuses a directory
        that already holds a finished snapshot, or a local one that others may write to."""
        if self.exists(MANIFEST):
            raise PathwaysError(f"{self.location} already holds a suspended cluster (its {MANIFEST}); resume from "
                                "it, or suspend into another directory")
        if self._fs is not None:
            self._fs.makedirs(self._root, exist_ok=True)
            return
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        self.check_private()

    def check_private(self) -> None:
        """PathwaysError unless a local snapshot directory belongs to this user and no one else may write to it
        (what it holds is every tenant's arrays and session keys)."""
        if self._fs is not None:
            return
        try:
            info = os.stat(self._root)
        except OSError as exc:
            raise PathwaysError(f"cannot use {self.location} as a snapshot directory: {exc}") from None
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PathwaysError(f"{self.location} is writable by others or not owned by this user (uid "
                                f"{os.getuid()}); a snapshot holds every tenant's arrays and keys: use a directory "
                                "only the runtime's user can write (chmod 700)")

    def children(self) -> list[str]:
        """The names of the entries directly in the directory (none if it does not exist)."""
        try:
            if self._fs is not None:
                return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
            return os.listdir(self._root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise PathwaysError(f"cannot list {self.location}: {exc}") from None

    def exists(self, name: str) -> bool:
        """Whether the snapshot has file ``name``."""
        if self._fs is not None:
            return self._fs.exists(self.path(name))
        return os.path.exists(self.path(name))

    def size(self, name: str) -> int:
        """The size of file ``name`` in bytes."""
        if self._fs is not None:
            return int(self._fs.size(self.path(name)))
        return os.path.getsize(self.path(name))

    def remove(self, name: str) -> None:
        """Delete file ``name`` if it is there."""
        try:
            if self._fs is not None:
                self._fs.rm(self.path(name))
            else:
                os.remove(self.path(name))
        except (FileNotFoundError, OSError):
            pass

    @contextmanager
    def open(self, name: str, mode: str) -> Iterator[IO[bytes]]:
        """File ``name`` opened for ``"rb"`` or ``"wb"``; a local file written is private and synced to disk."""
        if self._fs is not None:
            with self._fs.open(self.path(name), mode) as f:
                yield f
            return
        if mode == "rb":
            with open(self.path(name), "rb") as f:
                yield f
            return
        fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def write_json(self, name: str, value: Any) -> int:
        """Write ``value`` as JSON to ``name`` (whole, or not at all for a local file: written aside, then renamed);
        returns its checksum."""
        data = json.dumps(value, separators=(",", ":")).encode()
        if self._fs is not None:
            with self.open(name, "wb") as f:
                f.write(data)
            return checksum(data)
        aside = f"{name}.partial"
        with self.open(aside, "wb") as f:
            f.write(data)
        os.replace(self.path(aside), self.path(name))
        return checksum(data)

    def read_json(self, name: str, crc: int | None = None) -> Any:
        """The JSON value in ``name``; PathwaysError if it is missing, unreadable, or not what ``crc`` says."""
        try:
            with self.open(name, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise PathwaysError(f"{self.location}: cannot read {name}: {exc}") from None
        if crc is not None and checksum(data) != crc:
            raise PathwaysError(f"{self.location}: {name} is damaged (its checksum differs from the manifest's)")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise PathwaysError(f"{self.location}: {name} is not valid JSON: {exc}") from None
