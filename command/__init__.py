"""The ``pathways`` command: start a shared cluster, manage its tenants, submit their jobs, watch it, stop it.

It runs in an admin's or a tenant's shell, beside the user's process rather than in it: it uses the client's
connection to the runtime (``client``) and the shared vocabulary (``pathways``), and reaches the runtime only
over its protocol, or by running ``python -m resource_manager.launch`` for ``up`` and ``down``. It never imports
Ray, and starts without JAX.
"""
