"""Names of the runtime's Ray actors (so any process on the cluster finds them) and the id layout."""

NAMESPACE = "pathways"
RESOURCE_MANAGER = "resource_manager"
CLIENT_ID_BITS = 40  # buffer ids are (client id << 40) | counter, minted by the client


def host_name(island: int, host: int) -> str:
    return f"island-{island}-host-{host}"


FETCH_TIMED_OUT = "pathways:fetch-timed-out"  # a host's answer when a fetch outlives its timeout
