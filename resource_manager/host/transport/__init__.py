"""How a host's shards reach other hosts: one interface (``interface.Transport``), one file per transport behind it
(``channel``: a Unix socket per same-node peer, with shards lent through ``direct``, which copies them straight out
of the sender's memory; ``network/``: TCP between nodes; ``ray``: signed Ray actor calls through the object store),
and ``peers``: who the other hosts are, and the table that picks which transport reaches each."""
