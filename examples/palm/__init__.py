"""PaLM's pipeline-free two-pod training, run through the runtime.

Pure JAX, no runtime: ``config`` (shapes), ``model`` (the architecture and its
staged backward), ``data`` (byte-level stdlib text), ``optim`` (PaLM's
Adafactor), ``flops`` (MFU). On the runtime: ``step`` (the two-pod
``@pw.program``, donating parameters and optimizer state), ``peak`` (the
peak FLOP/s of the pods), ``train`` (the loop and its command line), with
``checkpoint``, ``spikes`` and ``logs``; ``zero_step`` (the step with ZeRO
stage 1, 2 or 3 over the pods); ``memory`` (peak buffer bytes with and without
donation, and by ZeRO stage).
"""
