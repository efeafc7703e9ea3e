"""Names every side agrees on: environment variables, files, the runtime's Ray namespace and resource manager, a
fetch's timeout answer, and the Ray settings of the clusters the runtime starts."""

# -- environment variables (read by pw.init, the `pathways` command and the runtime) --------------------------
ADDRESS_ENV = "PATHWAYS_ADDRESS"  # the runtime's address, pathways://HOST:PORT
TENANT_ENV = "PATHWAYS_TENANT"
CREDENTIAL_ENV = "PATHWAYS_CREDENTIAL"
TICKET_FD_ENV = "PATHWAYS_TICKET_FD"  # a job's inherited pipe holding its single-use ticket
JOB_ENV = "PATHWAYS_JOB"  # the id of the job a process runs as
HOME_ENV = "PATHWAYS_HOME"  # where the command and pw.init keep state and credentials (default ~/.pathways)
# where this machine's runtime publishes its address (default /tmp/pathways-runtime: a name that no script run
# from /tmp could mistake for the package)
TMPDIR_ENV = "PATHWAYS_TMPDIR"

# -- files ----------------------------------------------------------------------------------------------------
LOGIN_FILE = "login.json"  # under $PATHWAYS_HOME: a tenant's address, name and credential (`pathways login`)
CURRENT_FILE = "current"  # under $PATHWAYS_TMPDIR: the address of the runtime `pathways up` started here

NAMESPACE = "pathways"
RESOURCE_MANAGER = "resource_manager"
FETCH_TIMED_OUT = "pathways:fetch-timed-out"  # a host's answer when a fetch outlives its timeout

# Ray starts its workers at niceness 15, below the driver; the hosts are where the runtime computes, and a busy
# client would starve them. Clusters the runtime starts (pw.init's embedded one, `pathways up`) run them at 0.
# Ray also starts a worker per CPU ahead of any task, which no host takes (each has a runtime_env of its own): a
# cluster starts with 0.3-0.7 s less CPU without them.
RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "enable_worker_prestart": False, "prestart_worker_first_driver": False}
RAY_SYSTEM_ENV = {f"RAY_{k}": str(v).lower() for k, v in RAY_SYSTEM_CONFIG.items()}  # the same, for `ray start`
