"""How a host's shards reach other hosts: ``channel`` (a Unix socket per same-node peer), ``direct`` (copying
straight out of a same-node sender's memory), ``network/`` (TCP between nodes), and ``peers`` (who the other
hosts are, and which of these reaches each)."""
