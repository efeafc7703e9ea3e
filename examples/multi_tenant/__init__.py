"""Two tenants train at once on one shared cluster, with the weights the cluster's admin gave them.

Each tenant's job is a process the runtime starts (``pathways submit``) that runs ``train.py``:
``pw.init()`` attaches to the runtime (the job gets its address, ``PATHWAYS_ADDRESS``) and exchanges
the job's one-time ticket (handed over through a pipe) for a session of its tenant, whose weight
comes from the cluster's tenant registry; it takes a 2-device slice of island 0 and runs
linear-regression SGD steps through ``pw.jit``, printing its loss. Both tenants' slices sit on
island 0, so its scheduler interleaves their steps: alice (weight 1) and bob (weight 3) should get
about 1/4 and 3/4 of the island's time while both are busy.

From the repository root:

    pathways up                                  # Ray head + 2 islands x 1 host x 4 CPU devices, and
                                                 #   the admin credential in ~/.pathways/admin.token
    python -m examples.multi_tenant.submit       # as that admin: registers alice (weight 1) and bob
                                                 #   (weight 3) if they are missing, submits both, waits
    pathways status                              # in another terminal: slices per tenant, queues,
                                                 #   each tenant's share of island time
    pathways jobs                                # id, tenant, status, start, end
    pathways logs <job id> --follow              # one tenant's losses
    pathways down                                # islands gone; the head too, since `up` started it
                                                 #   (the registry stays for the next `up`)

One tenant by hand: ``pathways tenants add carol --weight 2`` (as the admin; it prints the
``pathways login`` command carol runs on her machine), then, as carol, ``cd examples/multi_tenant &&
pathways submit -- python train.py --steps 200``. Options of the submitter: ``python -m
examples.multi_tenant.submit --help``.
"""
