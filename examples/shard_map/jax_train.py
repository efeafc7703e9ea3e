"""The "Neural networks" section of JAX's shard_map tutorial (docs/notebooks/shard_map.md: data parallelism, FSDP
with ``jax.remat`` and ``all_gather``, tensor parallelism with ``psum_scatter``, FSDP with tensor parallelism, and
an SPMD pipeline with ``ppermute``): the starting point of the port in ``pw_train.py``.

    python -m examples.shard_map.jax_train

The tutorial's code as published, on a CPU mesh of simulated devices, inside ``main``: its 8 devices are
``main``'s ``devices`` (the tests run it on 4), its ``print`` s are ``show`` s, which also return what they
printed, the tensor-parallel loss it defines is run like the others, ``main`` keeps the pipeline's gradients
(the tutorial only checks that they are computed: NaN where its pipeline leaves them so) and unsets the mesh
it set.
"""

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = '--xla_force_host_platform_device_count=8' # Use 8 CPU devices

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import tree_all, tree_map

Explicit = jax.sharding.AxisType.Explicit
Auto = jax.sharding.AxisType.Auto


def allclose(a, b):
  return tree_all(tree_map(partial(jnp.allclose, atol=1e-2, rtol=1e-2), a, b))


def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs

def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b

def init(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)


def main(devices=8):
  shown = []

  def show(name, value):
    value = value.item() if hasattr(value, "item") else value
    print(f"{name}: {value}")
    shown.append((name, value))

  layer_sizes = [784, 128, 128, 128, 128, 128, 8]
  batch_size = 32

  params, batch = init(jax.random.key(0), layer_sizes, batch_size)

  # 8-way batch data parallelism

  mesh = jax.make_mesh((devices,), ('batch',))
  jax.set_mesh(mesh)

  # replicate initial params on all devices, shard data batch over devices
  batch = jax.device_put(batch, NamedSharding(mesh, P('batch')))
  params = jax.device_put(params, NamedSharding(mesh, P()))

  # adapt the loss function to sum the losses across devices
  @jax.shard_map(out_specs=P())
  def loss_dp(params, local_batch):
    inputs, targets = local_batch
    predictions = predict(params, inputs)  # use reference 'predict`
    local_loss = jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))
    return jax.lax.pmean(local_loss, 'batch')

  show("loss", jax.jit(loss)(params, batch))
  show("loss_dp", jax.jit(loss_dp)(params, batch))

  show("grads_dp close", allclose(jax.jit(jax.grad(loss))(params, batch),
                                  jax.jit(jax.grad(loss_dp))(params, batch)))

  # 8-way fully sharded data parallelism (FSDP)

  # shard data batch *and params* over devices
  mesh = jax.make_mesh((devices // 2,), ('batch',))
  jax.set_mesh(mesh)
  batch = jax.device_put(batch, P('batch'))
  params = jax.device_put(params, P('batch'))

  # adapt the prediction function to gather weights just before their use,
  # and to re-gather them on the backward pass (rather than saving them)
  @partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
  def predict_fsdp(params_frag, inputs):
    for W_frag, b_frag in params_frag:
      W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
      b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
      outputs = jnp.dot(inputs, W) + b
      inputs = jax.nn.relu(outputs)
    return outputs

  @jax.shard_map(out_specs=P())
  def loss_fsdp(local_params, local_batch):
    inputs, targets = local_batch
    predictions = predict_fsdp(local_params, inputs)
    local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
    return jax.lax.pmean(local_loss, 'batch')

  repl_params = jax.device_put(params, P())
  repl_batch = jax.device_put(batch, P())
  show("loss", jax.jit(loss)(repl_params, repl_batch))
  show("loss_fsdp", jax.jit(loss_fsdp)(params, batch))

  show("grads_fsdp close", allclose(jax.jit(jax.grad(loss))(repl_params, repl_batch),
                                    jax.jit(jax.grad(loss_fsdp))(params, batch)))

  # 8-way tensor parallelism (TP)

  mesh = jax.make_mesh((devices,), ('feats',))
  jax.set_mesh(mesh)

  batch = jax.device_put(batch, NamedSharding(mesh, P(None, 'feats')))
  params = jax.device_put(params, NamedSharding(mesh, P('feats')))

  def predict_tp(params, inputs):
    for W, b in params:
      outputs = gemm_tp(inputs, W, b)
      inputs = jax.nn.relu(outputs)
    return outputs

  @jax.shard_map(in_specs=(P(None, 'feats'), P('feats', None), P('feats')),
                 out_specs=P(None, 'feats'))
  def gemm_tp(inputs, W, b):
    block_result = jnp.dot(inputs, W)
    return jax.lax.psum_scatter(block_result, 'feats',
                                scatter_dimension=1, tiled=True) + b

  def loss_tp(params, batch):
    inputs, targets = batch
    predictions = predict_tp(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))  # NOTE psum!

  show("loss_tp", jax.jit(loss_tp)(params, batch))

  # FSDP + TP, with shard_map at the top level

  mesh = jax.make_mesh((devices // 2, 2), ('batch', 'feats'))
  jax.set_mesh(mesh)

  batch = jax.device_put(batch, NamedSharding(mesh, P('batch', 'feats')))
  params = jax.device_put(params, NamedSharding(mesh, P(('feats', 'batch'))))

  # mostly same as previous predict_fsdp definition, except we call gemm_tp
  @partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
  def predict_fsdp_tp(params_frag, inputs):
    for W_frag, b_frag in params_frag:
      W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
      b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
      block_result = jnp.dot(inputs, W)
      outputs = jax.lax.psum_scatter(block_result, 'feats',
                                     scatter_dimension=1, tiled=True) + b
      inputs = jax.nn.relu(outputs)
    return outputs

  @jax.shard_map(in_specs=(P(('feats', 'batch')), P('batch', 'feats')),
                 out_specs=P())
  def loss_fsdp_tp(local_params, local_batch):
    inputs, targets = local_batch
    predictions = predict_fsdp_tp(local_params, inputs)
    sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), 'feats')
    return jax.lax.pmean(jnp.mean(sq_err), 'batch')

  repl_params = jax.device_put(params, P())
  repl_batch = jax.device_put(batch, P())
  show("loss", jax.jit(loss)(repl_params, repl_batch))
  show("loss_fsdp_tp", jax.jit(loss_fsdp_tp)(params, batch))

  show("grads_fsdp_tp close", allclose(jax.jit(jax.grad(loss))(repl_params, repl_batch),
                                       jax.jit(jax.grad(loss_fsdp_tp))(params, batch)))

  # SPMD pipeline parallelism (PP)

  L = len(params) - 2        # num layers, excluding first and last
  N = batch_size             # batch size
  F = params[0][0].shape[1]  # num features

  # choose some pipeline parameters
  S = 2      # number of stages
  B = 8      # size of each microbatch
  assert L % S == 0, "S (number of stages) must divide L (number of inner layers)"

  # compute some useful quantities
  M, ragged = divmod(N, B)  # M is number of microbatches
  assert not ragged, "B (size of each microbatch) must divide total batch size"
  K, ragged = divmod(M, S)  # K is microbatches per stage
  assert not ragged, "S (number of stages) must divide number of microbatches"
  print(f'{S} stages, {L // S} layer(s) per stage, {L} pipelined layers total')
  print(f'{B} examples per microbatch, {M} microbatches total')

  mesh = Mesh(jax.devices()[:S], ('stages',))

  def predict_pp(params, inputs):
    (W_first, b_first), inner_params, (W_last, b_last) = params
    inputs = jax.nn.relu(jnp.dot(inputs, W_first) + b_first)
    inputs = spmd_pipeline(lambda Wb, x: jax.nn.relu(x @ Wb[0] + Wb[1]),
                          inner_params, inputs)
    outputs = jnp.dot(inputs, W_last) + b_last
    return outputs

  @jax.shard_map(in_specs=((P(), P('stages'), P()), P('stages')), out_specs=P())
  def loss_pp(params, batch):
    inputs, targets = batch
    predictions = predict_pp(params, inputs.reshape(K, B, -1)).reshape(K * B, -1)
    local_loss = jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))
    return jax.lax.pmean(local_loss, 'stages')

  def spmd_pipeline(fn, stage_params, inputs):
    stage = jax.lax.axis_index('stages')
    outputs = jnp.zeros_like(inputs) * jnp.nan
    state = jnp.zeros((L // S, B, F)) * jnp.nan
    for i in range(M+L-1):
      state = state.at[0].set(jnp.where(stage == 0, inputs[i % K], state[0]))
      state = jax.vmap(fn)(stage_params, state)
      outputs = outputs.at[(i-L+1) % K].set(jnp.where(stage == S-1, state[-1], outputs[(i-L+1) % K]))
      state, inputs, outputs = shift(i, state, inputs, outputs)
    outputs = jax.lax.ppermute(outputs, 'stages', [(i, (i+1) % S) for i in range(S)])
    return outputs

  def shift(i, state, inputs, outputs):
    sh = lambda x, d: jax.lax.ppermute(x, 'stages', [(i, (i+d) % S) for i in range(S)])  # noqa: E731
    state = jnp.roll(state, +1, axis=0).at[0].set(sh(state[-1], +1))
    if (i % K) == (-1 % K):
      inputs = sh(inputs, +1)
    if ((i-L+1) % K) == (-1 % K):
      outputs = sh(outputs, +1)
    return state, inputs, outputs

  first_params, *inner_params, last_params = params
  Ws, bs = zip(*inner_params)
  params_stacked = jnp.stack(Ws), jnp.stack(bs)
  first_params = jax.device_put(first_params, NamedSharding(mesh, P()))
  params_stacked = jax.device_put(params_stacked, NamedSharding(mesh, P('stages')))
  last_params = jax.device_put(last_params, NamedSharding(mesh, P()))
  params_ = first_params, params_stacked, last_params

  batch_ = jax.device_put(batch, NamedSharding(mesh, P('stages')))

  jax.set_mesh(mesh)
  show("loss_pp", jax.jit(loss_pp)(params_, batch_))

  _ = jax.jit(jax.grad(loss_pp))(params_, batch_)   # don't crash
  shown.append(("grads_pp", jax.device_get(_)))

  jax.set_mesh(None)
  return shown


if __name__ == "__main__":
  main()
