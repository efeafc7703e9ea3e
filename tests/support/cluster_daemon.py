"""Start an embedded cluster of a given topology in this process, print its address and the credentials of
the tenants it registered (it is the runtime's admin), and keep it up until standard input closes. Tests that
need a second topology (e.g. multi-host islands) run this:

    python tests/support/cluster_daemon.py ISLANDS HOSTS DEVICES [TENANT ...]
"""

from __future__ import annotations

import json
import sys

import pathways as pw


def main() -> None:
    islands, hosts, devices = (int(a) for a in sys.argv[1:4])
    session = pw.init(topology=pw.Topology(islands, hosts, devices))
    credentials = {tenant: pw.admin().add_tenant(tenant) for tenant in sys.argv[4:]}
    print(json.dumps({"address": session.address, "credentials": credentials}), flush=True)
    sys.stdin.read()
    pw.shutdown()


if __name__ == "__main__":
    main()
