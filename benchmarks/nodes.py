"""Two Ray nodes on this machine for the cross-node benchmarks, their daemons started by a process of their own.

Ray's ``cluster_utils.Cluster`` starts each node's daemons through a ``preexec_fn``, which runs Python in a forked
child. In a process where JAX already runs threads (a benchmark that measured on one node first), that is what JAX
warns may deadlock ("os.fork() was called"), and the warning is right to. So the cluster lives in a child process
that never imports JAX, and the benchmark only connects to it: ``TwoNodes`` starts that process, reads the
cluster's address and node ids from it, and ends it (and with it the cluster) on ``shutdown``.

    python -m benchmarks.nodes SPEC   # the child: SPEC is the JSON of TwoNodes' arguments; stdin closed = stop
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from typing import Any

START_TIMEOUT_S = 300.0  # two raylets and a GCS on a busy 2-core machine
STOP_TIMEOUT_S = 120.0


class TwoNodes:
    """A head and a worker node, each with one CPU and an object store of ``store_bytes`` (None: Ray's default);
    with ``label_key``, the labels ``head`` and ``worker`` under it tell them apart to placement; ``system_config``
    is the head's Ray system config. ``address``, ``head`` and ``worker`` (node ids) are known once the constructor
    returns; RuntimeError when it could not start them within ``START_TIMEOUT_S`` (the child's own error is on
    stderr)."""

    def __init__(self, store_bytes: int | None = None, label_key: str | None = None,
                 system_config: dict | None = None) -> None:
        spec = {"store_bytes": store_bytes, "label_key": label_key, "system_config": system_config or {}}
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.nodes", json.dumps(spec)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started = self._started(START_TIMEOUT_S)
        if started is None:
            self.shutdown()
            raise RuntimeError(f"the two-node cluster did not start within {START_TIMEOUT_S:.0f}s (its process's "
                               "error, if any, is above)")
        self.address, self.head, self.worker = started["address"], started["head"], started["worker"]

    def _started(self, timeout: float) -> dict | None:
        """The child's report (a JSON line; whatever else it prints on stdout is passed on), or None if it ended or
        said nothing within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._proc.stdout], [], [], 1.0)
            if not ready:
                if self._proc.poll() is not None:
                    return None
                continue
            line = self._proc.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                return json.loads(line)
            print(line, end="", file=sys.stderr)
        return None

    def shutdown(self) -> None:
        """Stop both nodes: the child shuts its cluster down when its stdin closes (killed if it takes too long)."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


def serve(spec: dict[str, Any]) -> None:
    """The child: start the two nodes, print their address and node ids, and keep them until stdin closes."""
    from ray.cluster_utils import Cluster

    def node(name: str) -> dict[str, Any]:
        args: dict[str, Any] = {"num_cpus": 1}
        if spec["store_bytes"] is not None:
            args["object_store_memory"] = spec["store_bytes"]
        if spec["label_key"] is not None:
            args["labels"] = {spec["label_key"]: name}
        return args

    cluster = Cluster(initialize_head=True, head_node_args={**node("head"), "include_dashboard": False,
                                                            "_system_config": spec["system_config"]})
    try:
        worker = cluster.add_node(**node("worker"))
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id, "worker": worker.node_id}),
              flush=True)
        sys.stdin.read()  # until the benchmark closes it (or dies)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    if "jax" in sys.modules:
        raise SystemExit("benchmarks.nodes must start its nodes from a process without JAX")
    serve(json.loads(sys.argv[1]))
