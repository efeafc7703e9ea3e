"""The cross-node data path: island hosts on different Ray nodes push array shards to each other over TCP.

Without it, shards between Ray nodes travel as Ray actor calls through the object stores: the sender's store,
Ray's object manager, the receiver's store, then a copy into the host's memory, several times slower than
one plain TCP connection between the same hosts (``benchmarks/network_transports.py`` measures both;
``docs/network.md``). This package is that plain TCP connection, made safe to leave open between hosts:

* ``frames``: what a data connection proves and carries (the client protocol's handshake and framing, a data
  header per chunk) and the pure arithmetic of cutting shards into chunks;
* ``server``: each host's data server, which authenticates peers and lands chunks in its buffer pool;
* ``receives``: which receives the lowered plan names for which sender, checked before data is accepted;
* ``links``: the sending side, a pool of connections per peer over which chunks stream in parallel;
* ``path``: the host's network path, tying the three together as the ``network`` transport of ``transport.peers``.
"""
