"""One island host: the thin Ray actor and the parts beneath it.

``actor`` is the Ray actor (every method checks its caller and forwards); beneath it, in the order a
client's message flows: ``admission`` (decode once, check in meaning, each client's order), ``scheduler``
(one total order and fair share, host 0), ``inbox`` (the ordered stream into the executor), ``executor``
(the loop), ``handlers`` (what each op does), ``receive`` (landing what peers send), ``buffers`` (the
buffer table), ``executables`` (the compile cache). ``transport/`` moves bytes between hosts: ``channel``
and ``direct`` on one node, ``network/`` across nodes, ``peers`` choosing between them.
"""
