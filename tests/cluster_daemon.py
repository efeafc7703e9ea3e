"""Start an embedded cluster of a given topology in this process, print its address, and keep it up
until standard input closes. Tests that need a second topology (e.g. multi-host islands) run this."""

from __future__ import annotations

import json
import sys

import ray

import pathways as pw


def main() -> None:
    islands, hosts, devices = (int(a) for a in sys.argv[1:4])
    pw.init(topology=pw.Topology(islands, hosts, devices))
    print(json.dumps({"address": ray.get_runtime_context().gcs_address}), flush=True)
    sys.stdin.read()
    pw.shutdown()


if __name__ == "__main__":
    main()
