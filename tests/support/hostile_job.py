"""A hostile tenant's job: it tries to read, list, write or take over what is not its own, and prints one JSON line
saying what happened to each try (``denied: ...``, ``allowed``, or ``missing: ...``).

    python hostile_job.py '{"read": [PATH...], "list": [DIR...], "write": [DIR...], "environ": [PID...],
                            "memory": [PID...], "ray": [GCS_ADDRESS]}'

The tests ship it as a job's working directory and check that every try was denied.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except FileNotFoundError as exc:
        return f"missing: {exc}"
    except OSError as exc:
        return f"denied: {type(exc).__name__}: {exc}"
    return "allowed"


def read(path: str) -> None:
    with open(path, "rb") as f:
        f.read(1)


def write_in(folder: str) -> None:
    path = os.path.join(folder, f"planted-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(b"x")
    os.unlink(path)


def memory(pid: str) -> None:
    with open(f"/proc/{pid}/maps") as f:  # where the process keeps something: its first mapping
        start = int(f.readline().split("-")[0], 16)
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(start)
        f.read(16)


def attach_to_ray(address: str) -> None:
    os.environ["RAY_NUM_REDIS_GET_RETRIES"] = "3"  # an attacker's patience: Ray retries a refusal for 20 s
    import ray

    try:
        ray.init(address=address, logging_level="ERROR")
        ray.get_actor("resource_manager", namespace="pathways")
    except Exception as exc:  # Ray's refusals are not OSErrors
        text = str(exc.__cause__ or exc)
        token = " (InvalidAuthToken)" if "InvalidAuthToken" in text else ""
        raise PermissionError(f"{type(exc).__name__}{token}: {text[:200]}") from None


def main() -> None:
    targets = json.loads(sys.argv[1])
    out = {}
    for path in targets.get("read", []):
        out[f"read {path}"] = attempt(lambda p=path: read(p))
    for folder in targets.get("list", []):
        out[f"list {folder}"] = attempt(lambda d=folder: os.listdir(d))
    for folder in targets.get("write", []):
        out[f"write in {folder}"] = attempt(lambda d=folder: write_in(d))
    for pid in targets.get("environ", []):
        out[f"environ of {pid}"] = attempt(lambda p=pid: read(f"/proc/{p}/environ"))
    for pid in targets.get("memory", []):
        out[f"memory of {pid}"] = attempt(lambda p=pid: memory(p))
    for address in targets.get("ray", []):
        out[f"attach to Ray at {address}"] = attempt(lambda a=address: attach_to_ray(a))
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
