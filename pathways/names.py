"""Names every side agrees on: the runtime's Ray namespace and resource manager, a fetch's timeout answer, and
the Ray settings of the clusters the runtime starts."""

NAMESPACE = "pathways"
RESOURCE_MANAGER = "resource_manager"
FETCH_TIMED_OUT = "pathways:fetch-timed-out"  # a host's answer when a fetch outlives its timeout

# Ray starts its workers at niceness 15, below the driver; the hosts are where the runtime computes, and a busy
# client would starve them. Clusters the runtime starts (pw.init's embedded one, `pathways up`) run them at 0.
RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
RAY_SYSTEM_ENV = {f"RAY_{k}": str(v) for k, v in RAY_SYSTEM_CONFIG.items()}  # the same, for `ray start`
