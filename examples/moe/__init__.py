"""A GShard-style mixture-of-experts Transformer, on one island or with its experts spread over several.

``model`` is the network as ordinary JAX (top-2 gating with a capacity, the auxiliary balancing loss, experts
in every other layer); ``routing`` computes who goes where; ``placement`` says which island holds which expert
and is the controller's policy; ``stages`` and ``program`` are the cross-island step's computations and its
program; ``step`` runs a training step on one island (experts sharded over its devices, all-to-all inside one
computation) or across islands (one ``@pw.program`` per step); ``train`` is the loop.
"""
