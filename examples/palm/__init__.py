"""A PaLM-architecture byte-level language model in pure JAX.

Nothing here imports the runtime: the training script wires these pieces
(config, model, data, optimizer, FLOPs accounting) into it.
"""
