"""The runtime's client protocol: how a tenant's process talks to the resource manager and the islands' hosts.

A client never holds a Ray handle. It connects over TCP to the runtime's endpoints (the resource manager's
address, ``pathways://HOST:PORT``, and the hosts' addresses the resource manager hands out) and speaks:

* ``handshake``: who the endpoint is (runtime, role, island, host, epoch) and which session the client holds,
  proven both ways with fresh nonces; both sides then share a key for this one connection;
* ``frames``: the byte layout of every message after the handshake: a sequence number that must be the next
  one, a MAC under the connection's key over the sequence number and the message, the msgpack message
  (``pathways.wire``), and raw array bytes after it;
* ``connection``: a socket speaking both, used by the client and the runtime alike (the hosts' network data path
  speaks it between hosts too);
* ``address``: the ``pathways://`` address form.

A message is therefore bound to its session, its destination and its place in the connection's stream: a
replay on another connection, endpoint, epoch or runtime fails its MAC, and one on the same connection fails
its sequence number. See docs/protocol.md for the measurements behind choosing framed TCP over gRPC.
"""
