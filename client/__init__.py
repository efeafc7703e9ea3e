"""The client side of the runtime: what runs in the user's process.

Tracing (``tracer``, ``program``), compiled functions (``jit``), lowering and dispatch, array handles
(``array``), and the session with the cluster (``session``, ``runtime``, ``outbox``). Users import ``pathways``;
this package is its implementation. The ``pathways`` command, which runs beside the user's process, is ``command``.
"""
