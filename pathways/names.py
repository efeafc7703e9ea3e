"""Names every side agrees on: the runtime's Ray namespace and resource manager, and a fetch's timeout answer."""

NAMESPACE = "pathways"
RESOURCE_MANAGER = "resource_manager"
FETCH_TIMED_OUT = "pathways:fetch-timed-out"  # a host's answer when a fetch outlives its timeout
