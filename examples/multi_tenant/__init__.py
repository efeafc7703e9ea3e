"""Two tenants train at once on one shared cluster, with different weights.

Each tenant's job is an ordinary Ray job (submitted through Ray's job submission API) that runs
``train.py``: ``pw.init()`` attaches to the running cluster (the job gets ``RAY_ADDRESS``) as the
tenant named by ``PATHWAYS_TENANT`` with the weight in ``PATHWAYS_WEIGHT``, takes a 2-device slice
of island 0, and runs linear-regression SGD steps through ``pw.jit``, printing its loss. Both
tenants' slices sit on island 0, so its scheduler interleaves their steps: alice (weight 1) and
bob (weight 3) should get about 1/4 and 3/4 of the island's time while both are busy.

From the repository root (the head needs the dashboard, which ``pathways up`` starts):

    pathways up                                  # Ray head + 2 islands x 1 host x 4 CPU devices
    python -m examples.multi_tenant.submit       # submits alice (weight 1) and bob (weight 3), waits
    pathways status                              # in another terminal: slices per tenant, queues,
                                                 #   each tenant's share of island time
    pathways jobs                                # id, tenant, status, start, end
    pathways logs <job id> --follow              # one tenant's losses
    pathways down                                # islands gone; the head too, since `up` started it

One tenant by hand: ``cd examples/multi_tenant && pathways submit --tenant carol --weight 2 -- python
train.py --steps 200``. Options of the submitter: ``python -m examples.multi_tenant.submit --help``.
"""
