"""The cluster side of the runtime: the resource manager and the islands it starts.

``manager`` is the resource manager (the authority for tenants, sessions, slices and island health);
``island`` and ``nodes`` start an island's host actors on Ray nodes; ``host`` is one island host, with
admission, the scheduler (host 0) and the executor beneath it; ``network`` is the direct host-to-host
data path between nodes.
"""
