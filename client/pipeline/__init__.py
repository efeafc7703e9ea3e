"""Pipeline parallelism from one annotated training step (``pw.pipeline``).

    def model(params, x):
        for k, layer in enumerate(params):
            x = block(layer, x)
            if k % 2 == 1:
                x = pw.pipeline.end_stage(x)        # two layers per stage
        return x

    step = pw.pipeline.jit(train_step, slices=[s0, s1, s2, s3], n_micro=8, schedule="zb-h1", batch_argnums=(2, 3))
    params, opt_state, loss = step(params, opt_state, x, y)

The parts, one concept each: ``marker`` (the stage mark), ``trace`` (the step as a flat list of equations),
``split`` (the cut into per-stage forward, backward, weight-gradient and update tasks), ``schedules`` (the
schedules as data, with their bubble formulas), ``order`` (the emission order and the activations each
slice holds), ``runner`` (the program that runs a schedule) and ``timeline`` (the bubble measured from a
``pw.trace`` of the hosts).
"""

from client.pipeline.marker import end_stage
from client.pipeline.order import SliceMemory
from client.pipeline.runner import Pipeline, jit
from client.pipeline.schedules import SCHEDULES, Schedule, Work, bubble, make

__all__ = ["SCHEDULES", "Pipeline", "Schedule", "SliceMemory", "Work", "bubble", "end_stage", "jit", "make"]
