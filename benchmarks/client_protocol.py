"""The client protocol's two candidates, measured side by side: gRPC (grpcio) and framed TCP with a handshake.

A tenant's client sends an island host two kinds of traffic: a stream of small messages (a program call is a
few hundred bytes of msgpack) and requests that wait for an answer (a fetch). Both candidates carry the same
msgpack payloads to a server process that decodes every one, as a host does:

  latency     one request, one answer, in a loop (a fetch of a ready value; median round trip)
  stream      messages one per send, as fast as the client can; the server acknowledges the last one
  batched     the same messages, 32 per send (what the client's outbox does while the host is busy)
  4 MiB data  one request that carries 4 MiB of array bytes beside the message (a put), answered

gRPC runs unary calls for request/answer and one bidirectional stream for the streams, with bytes passed
through (no protobuf); framed TCP is ``pathways.protocol`` itself, with its per-frame MAC. The server is a
separate process, so client and server each have a core, as a client and an island host do.

    python -m benchmarks.client_protocol [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack

from benchmarks.common import Table, default_out, median, rate_text, write_json
from pathways.errors import PathwaysError
from pathways.protocol.connection import accept, connect
from pathways.protocol.handshake import Identity

KEY = b"k" * 32
SESSION = 7
MESSAGE = msgpack.packb({"v": 2, "kind": "call", "template": b"t" * 32, "base": 1 << 40, "inputs": [1 << 40 + 3],
                         "exes": {}, "frees": []})
IDENTITY = Identity("bench", "host", 0, 0, 0)
DATA_BYTES = 4 << 20


# -- servers ---------------------------------------------------------------------------------------------

def serve_tcp(listener: socket.socket) -> None:
    """Framed TCP: one thread per connection; every payload decoded; requests answered at once."""
    def one(sock: socket.socket) -> None:
        sink = bytearray(DATA_BYTES)
        try:
            conn = accept(sock, IDENTITY, lambda s: KEY if s == SESSION else None, False, 1 << 30, 1 << 30)
            while True:
                frame = conn.recv()
                msg = msgpack.unpackb(frame.payload)
                if frame.data:
                    conn.read_into(memoryview(sink)[:frame.data])
                if isinstance(msg, list):  # a batch
                    for m in msg:
                        msgpack.unpackb(m)
                    msg = msg[-1]
                    msg = msgpack.unpackb(msg)
                if msg.get("answer"):
                    conn.send(msgpack.packb({"ok": True}))
        except (ConnectionError, OSError, PathwaysError):  # the start-up probe, or the client went away
            pass

    while True:
        sock, _ = listener.accept()
        threading.Thread(target=one, args=(sock,), daemon=True).start()


def serve_grpc(port: int) -> None:
    """gRPC: a unary method for request/answer and a bidirectional stream; bytes in, bytes out."""
    import grpc

    def unary(request: bytes, context: object) -> bytes:
        msgpack.unpackb(request)
        return msgpack.packb({"ok": True})

    def stream(requests: object, context: object) -> object:
        for raw in requests:
            msg = msgpack.unpackb(raw)
            if isinstance(msg, list):
                for m in msg:
                    msgpack.unpackb(m)
                msg = msgpack.unpackb(msg[-1])
            if msg.get("answer"):
                yield msgpack.packb({"ok": True})

    handler = grpc.method_handlers_generic_handler("pathways.Host", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


# -- clients ---------------------------------------------------------------------------------------------

class Tcp:
    """The framed-TCP client: one connection, the protocol's handshake and frames."""

    def __init__(self, port: int) -> None:
        self.conn = connect(f"127.0.0.1:{port}", SESSION, KEY, lambda i: None, 1 << 30, 1 << 30)

    def ask(self, msg: bytes, data: bytes = b"") -> None:
        self.conn.send(msg, [data] if data else ())
        self.conn.recv()

    def stream(self, n: int, batch: int, last: bytes) -> None:
        for k in range(0, n - 1, batch):
            count = min(batch, n - 1 - k)
            self.conn.send(MESSAGE if batch == 1 else msgpack.packb([MESSAGE] * count))
        self.conn.send(last)
        self.conn.recv()


class Grpc:
    """The gRPC client: a channel, a unary stub and a streaming stub."""

    def __init__(self, port: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.unary = self.channel.unary_unary("/pathways.Host/Unary")
        self.streaming = self.channel.stream_stream("/pathways.Host/Stream")

    def ask(self, msg: bytes, data: bytes = b"") -> None:
        self.unary(msgpack.packb([msg, data]) if data else msg, timeout=60)

    def stream(self, n: int, batch: int, last: bytes) -> None:
        def messages() -> object:
            for k in range(0, n - 1, batch):
                count = min(batch, n - 1 - k)
                yield MESSAGE if batch == 1 else msgpack.packb([MESSAGE] * count)
            yield last
        for _ in self.streaming(messages(), timeout=120):
            break


def measure(client: Tcp | Grpc, reps: int, n_stream: int) -> dict[str, list[float]]:
    ask = msgpack.packb({"v": 2, "kind": "fetch", "id": 5, "timeout": 1.0, "ready_only": False, "answer": True})
    data = os.urandom(DATA_BYTES)
    out: dict[str, list[float]] = {"latency_us": [], "stream_per_s": [], "batched_per_s": [], "data_gbs": []}
    for _ in range(200):
        client.ask(ask)
    for _ in range(reps):
        lat = []
        for _ in range(500):
            t = time.perf_counter()
            client.ask(ask)
            lat.append(time.perf_counter() - t)
        out["latency_us"].append(median(lat) * 1e6)
        for name, batch in (("stream_per_s", 1), ("batched_per_s", 32)):
            t = time.perf_counter()
            client.stream(n_stream, batch, ask)
            out[name].append(n_stream / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(8):
            client.ask(ask, data)
        out["data_gbs"].append(8 * DATA_BYTES / (time.perf_counter() - t) / 1e9)
    return out


def start_server(kind: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.client_protocol", "--serve", kind, str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the {kind} server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(default_out("client_protocol")))
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        kind, port = args.serve[0], int(args.serve[1])
        if kind == "tcp":
            listener = socket.create_server(("127.0.0.1", port))
            serve_tcp(listener)
        else:
            serve_grpc(port)
        return
    reps, n_stream = (3, 10_000) if args.quick else (7, 30_000)
    results: dict[str, dict[str, list[float]]] = {}
    servers = {kind: start_server(kind) for kind in ("tcp", "grpc")}
    try:
        clients: dict[str, Callable[[], Tcp | Grpc]] = {"tcp": lambda: Tcp(servers["tcp"][1]),
                                                         "grpc": lambda: Grpc(servers["grpc"][1])}
        made = {k: make() for k, make in clients.items()}
        for _ in range(reps):  # alternate, so the machine's noise hits both
            for kind, client in made.items():
                one = measure(client, 1, n_stream)
                for key, values in one.items():
                    results.setdefault(kind, {}).setdefault(key, []).extend(values)
    finally:
        for proc, _ in servers.values():
            proc.kill()
    table = Table(["measure", "framed TCP", "gRPC", "TCP / gRPC"])
    rows = (("request/answer latency (median us)", "latency_us", lambda v: f"{v:.0f}", True),
            ("stream, one message per send (msgs/s)", "stream_per_s", rate_text, False),
            ("stream, 32 per send (msgs/s)", "batched_per_s", rate_text, False),
            ("4 MiB request, answered (GB/s)", "data_gbs", lambda v: f"{v:.2f}", False))
    summary = {}
    for label, key, fmt, lower_better in rows:
        t, g = median(results["tcp"][key]), median(results["grpc"][key])
        ratio = g / t if lower_better else t / g
        summary[key] = {"tcp": t, "grpc": g, "advantage": ratio}
        table.add(label, fmt(t), fmt(g), f"{ratio:.2f}x" + (" faster" if lower_better else ""))
    print(table.render())
    write_json(Path(args.out), {"reps": reps, "stream_messages": n_stream, "results": results, "summary": summary})
    print(f"client protocol: framed TCP is {summary['latency_us']['advantage']:.2f}x faster per request and "
          f"{summary['stream_per_s']['advantage']:.2f}x / {summary['batched_per_s']['advantage']:.2f}x the stream "
          f"rate (single / batched) of gRPC")


if __name__ == "__main__":
    main()
