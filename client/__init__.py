"""The client side of the runtime: what runs in the user's process.

Tracing (``tracer``, ``program``), compiled functions (``jit``), lowering and dispatch, array handles
(``array``), the session with the cluster (``session``, ``runtime``, ``outbox``), and the ``pathways``
command (``cli``, ``jobs``). Users import ``pathways``; this package is its implementation.
"""
