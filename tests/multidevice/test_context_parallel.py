"""On 8 simulated devices: context parallelism (each sequence split over the `context` mesh axis, attention's keys
and values exchanged by all-gather or round a ring of ppermutes, on the natural or the zigzag layout) gives one
device's loss and gradients, alone and composed with fsdp, tensor and data; training steps and a checkpoint carried
across a changed context axis too; zigzag skips the masked work the plain ring computes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax.checkpoint import train_state as checkpoint_lib
from llama_jax.core import model_config as model_config_lib
from llama_jax.core import run_config as run_config_lib
from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
from llama_jax.model import attention as attention_lib
from llama_jax.model import context as context_lib
from llama_jax.model import loss as loss_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.training.trainer import Trainer
from tests.multidevice.test_sharded_model import shard_batch
from tests.multidevice.test_training_meshes import BATCHES, run_steps

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")
RULES = DEFAULT_LOGICAL_AXIS_RULES
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)
MESHES = {
  "context8": dict(data=1, fsdp=1, context=8, tensor=1),
  "context2_fsdp4": dict(data=1, fsdp=4, context=2, tensor=1),
  "context2_tensor2_data2": dict(data=2, fsdp=1, context=2, tensor=2),
}
STRATEGIES = model_config_lib.CONTEXT_STRATEGIES
TOL = 1e-5


def batch_of(seed=0, length=64):
  """Packed rows with padding, documents crossing the shard boundaries: segment ids travel with their tokens."""
  rs = np.random.RandomState(seed)
  tokens = rs.randint(0, CFG.vocab_size, (8, length + 1))
  segment_ids = np.ones((8, length), np.int32)
  segment_ids[1, 13:] = 2
  segment_ids[1, 40:] = 3
  segment_ids[3, 50:] = 0
  segment_ids[5, 7:] = 2
  return dict(
    inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, weights=(segment_ids != 0).astype(np.float32)
  )


def loss_and_grads(cfg, mesh, params, batch):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))

  def objective(p, b):
    losses, weights, _ = loss_lib.losses_and_router(p, graphdef, b)
    return jnp.sum(losses * weights) / jnp.sum(weights)

  with sharding.activate(mesh, RULES):
    batch = shard_batch(batch, mesh, RULES)
    params = jax.device_put(params, sharding.shardings_of(sharding.abstract_params(Llama, cfg, mesh, RULES)[1]))
    step = jax.jit(jax.value_and_grad(objective))
    hlo = step.lower(params, batch).compile().as_text()
    loss, grads = step(params, batch)
  return float(loss), jax.tree.map(np.asarray, grads), hlo


@pytest.fixture(scope="module")
def reference():
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(sharding.init_model(Llama, CFG, mesh, RULES, seed=3))))
  loss, grads, _ = loss_and_grads(CFG, mesh, params, batch_of())
  return params, loss, grads


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mesh_name", MESHES)
def test_context_parallel_loss_and_gradients_equal_one_device(reference, mesh_name, strategy):
  params, loss_1, grads_1 = reference
  mesh = sharding.make_mesh(MESHES[mesh_name])
  loss, grads, hlo = loss_and_grads(CFG.replace(context_strategy=strategy), mesh, params, batch_of())
  assert loss == pytest.approx(loss_1, rel=TOL)
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1)):
    scale = max(float(np.abs(expected).max()), 1.0)
    assert np.abs(got - expected).max() <= TOL * scale, jax.tree_util.keystr(path)
  # The exchange each strategy promises: the ring passes blocks on by collective-permute (forward, and back in the
  # gradient), the all-gather strategy gathers them (and reduce-scatters their gradient).
  if strategy != "all_gather":
    assert hlo.count("collective-permute(") >= 2 * (MESHES[mesh_name]["context"] - 1)
  else:
    assert "all-gather(" in hlo


@pytest.mark.parametrize(
  "mesh_name, head_once",
  [
    ("context8", "none"),
    ("context2_fsdp4", "none"),
    ("context2_fsdp4", "weights"),
    ("context2_fsdp4", "weights_and_gradient"),
  ],
)
def test_the_loss_in_chunks_of_each_context_slice_equals_one_device(reference, mesh_name, head_once):
  """model.loss_chunk under context parallelism cuts the chunks within each device's slice (one chunk of every slice
  per scan step): 24-token chunks of 8-token slices (context 8: one chunk, mostly padding) and of 32-token slices
  (context 2: two chunks, the second padded) give one device's unchunked loss and gradients; so does the head
  gathered once for all chunks, with its gradient reduced per chunk or once (model.loss_head_once; what each saves
  the TPU compiler shows: tests/analysis/test_tpu_compile.py)."""
  params, loss_1, grads_1 = reference
  cfg = CFG.replace(context_strategy="ring", loss_chunk=24, loss_head_once=head_once)
  mesh = sharding.make_mesh(MESHES[mesh_name])
  loss, grads, _ = loss_and_grads(cfg, mesh, params, batch_of())
  assert loss == pytest.approx(loss_1, rel=TOL)
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1)):
    assert np.abs(got - expected).max() <= TOL * max(float(np.abs(expected).max()), 1.0), jax.tree_util.keystr(path)


def split_equals_one_device(split, mesh_axes, q, k, v, segments, atol):
  """`split` (attention over a context axis) run on `mesh_axes` with q, k, v and segment ids split as the
  activations' rules say: its output and gradients (of sum(out · w), random w) equal the one-device XLA kernel's.
  Returns (output, gradients) on the mesh."""
  weights = np.random.RandomState(7).normal(size=q.shape).astype(np.float32)

  def objective(kernel):
    return lambda q, k, v, s: jnp.sum(kernel(q, k, v, s) * weights)

  one = lambda q, k, v, s: attention_lib.xla_attention(q, k, v, q_segment_ids=s, kv_segment_ids=s)  # noqa: E731
  expected = one(q, k, v, segments)
  expected_grads = jax.grad(objective(one), argnums=(0, 1, 2))(q, k, v, segments)
  mesh = sharding.make_mesh(mesh_axes)
  with sharding.activate(mesh, RULES):
    place = lambda x, axes: shard_batch(x, mesh, RULES, axes)  # noqa: E731
    q_s = place(q, ("activation_batch", "activation_length", "activation_heads", None))
    k_s, v_s = (place(x, ("activation_batch", "activation_length", "activation_kv_heads", None)) for x in (k, v))
    segments_s = place(segments, ("activation_batch", "activation_length"))
    out = jax.jit(split)(q_s, k_s, v_s, segments_s)
    grads = jax.jit(jax.grad(objective(split), argnums=(0, 1, 2)))(q_s, k_s, v_s, segments_s)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=atol)
  for got, want in zip(grads, expected_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * max(1.0, float(np.abs(want).max())))
  return out, grads


def split_attention(q, k, v, segments, *, strategy, interpret=False):
  """`context_attention` by `strategy` in the natural layout (zigzag's moved there and back)."""
  if strategy != "zigzag":
    return context_lib.context_attention(q, k, v, segment_ids=segments, strategy=strategy, interpret=interpret)
  zig = lambda x: context_lib.to_zigzag(x, ("activation_batch", "activation_length") + (None,) * (x.ndim - 2))  # noqa: E731
  out = context_lib.context_attention(
    zig(q), zig(k), zig(v), segment_ids=zig(segments), strategy=strategy, interpret=interpret
  )
  return context_lib.from_zigzag(out, ("activation_batch", "activation_length", None, None))


@pytest.mark.parametrize("length", [64, 1024])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_device_holds_its_slice_of_the_sequence_and_the_attention_equals_the_unsplit(
  strategy, length, monkeypatch
):
  """Attention alone, with GQA and packed segments, split over context=4 × data=2: output and gradients equal the
  one-device kernel's, and the output stays split over the sequence (never gathered whole on a device). At 1,024
  tokens, with LONG_SEQUENCE lowered to 256, each device's 256-token slice is attended by query chunks of 64
  (the path of sequences of 2,048 tokens or more)."""
  monkeypatch.setattr(attention_lib, "LONG_SEQUENCE", 256)
  rs = np.random.RandomState(1)
  q = rs.normal(size=(2, length, 4, 16)).astype(np.float32)
  k, v = (rs.normal(size=(2, length, 2, 16)).astype(np.float32) for _ in range(2))
  segments = np.ones((2, length), np.int32)
  segments[0, length // 2 - 2 :] = 2
  segments[1, length - 5 :] = 0

  split = functools.partial(split_attention, strategy=strategy)
  out, _ = split_equals_one_device(split, dict(data=2, fsdp=1, context=4, tensor=1), q, k, v, segments, atol=2e-6)
  assert {shard.data.shape for shard in out.addressable_shards} == {(1, length // 4, 4, 16)}


def run_config(mesh, steps=6, **model):
  cfg = run_config_lib.base_run_config()
  cfg.model.update(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64, **model)
  cfg.mesh.update(**mesh)
  cfg.train.update(batch_size=8, seq_len=32, steps=steps, warmup_steps=2, lr=1e-3)
  cfg.seed = 7
  return cfg


def make_trainer(mesh, devices=None, **model):
  cfg = run_config(mesh, **model)
  return Trainer(model_config_lib.model_config_from(cfg), cfg, sharding.make_mesh(cfg.mesh, devices))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_steps_with_context_2_match_one_device_and_a_checkpoint_moves_to_context_1(tmp_path, strategy):
  """Three steps at context=2 × fsdp=4 equal one device's; saved, restored at context=1 × fsdp=8 (another sharding of
  the same arrays) the next three equal one device's too."""
  one = make_trainer(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  _, losses_1 = run_steps(one, one.init_state(), BATCHES[:6])
  trainer = make_trainer(dict(fsdp=4, context=2), context_strategy=strategy)
  state, losses = run_steps(trainer, trainer.init_state(), BATCHES[:3])
  np.testing.assert_allclose(losses, losses_1[:3], rtol=1e-5)
  checkpointer = checkpoint_lib.TrainCheckpointer(str(tmp_path))
  checkpointer.save(3, state, {"next_index": 3})
  checkpointer.close()
  moved = make_trainer(dict(fsdp=8, context=1))
  checkpointer = checkpoint_lib.TrainCheckpointer(str(tmp_path))
  restored, _ = checkpointer.restore(3, moved.abstract_state())
  checkpointer.close()
  _, later = run_steps(moved, restored, BATCHES[3:6])
  np.testing.assert_allclose(later, losses_1[3:], rtol=1e-5)


@pytest.mark.parametrize(
  "mesh, block",
  [(dict(data=2, fsdp=1, context=4, tensor=1), 128), (dict(data=2, fsdp=1, context=2, tensor=2), 512)],
  ids=["context4_data2_blocks128", "context2_tensor2_data2_blocks512"],
)
def test_splash_inside_the_all_gather_strategy_s_slices_equals_the_unsplit_attention(mesh, block):
  """The TPU kernel of the all-gather strategy, run by the Pallas interpreter: each device's slice of one splash
  block of queries (128 tokens, or 512, the tiles of slices that divide into them), so that the query rows of the
  kernel's mask tables split evenly, against the gathered keys, with GQA and packed segments that cross slices.
  Output and gradients equal the one-device XLA kernel's; q, k and v stay split."""
  rs = np.random.RandomState(2)
  length = block * mesh["context"]
  q = rs.normal(size=(2, length, 4, 64)).astype(np.float32)
  k, v = (rs.normal(size=(2, length, 2, 64)).astype(np.float32) for _ in range(2))
  segments = np.ones((2, length), np.int32)
  segments[0, 100:300] = 2
  segments[1, length - 70 :] = 3

  split = lambda q, k, v, s: context_lib.context_attention(q, k, v, segment_ids=s, interpret=True)  # noqa: E731
  _, grads = split_equals_one_device(split, mesh, q, k, v, segments, atol=2e-5)
  for got in grads:
    assert {shard.data.shape[1] for shard in got.addressable_shards} == {block}
  kernel = attention_lib.splash_kernel(2, length, length, q_seq_shards=mesh["context"])
  assert kernel.kwargs["block_sizes"].block_q == kernel.kwargs["block_sizes"].block_kv_dkv == block


@pytest.mark.parametrize("strategy, block", [("ring", 128), ("zigzag", 256)])
def test_splash_on_the_ring_s_blocks_equals_the_unsplit_attention_with_its_own_backward_pass(
  strategy, block, monkeypatch
):
  """The ring and zigzag with splash on every block (the Pallas interpreter) on context 4 × data 2: each block's
  output merged by the kernel's log-sum-exp, gradients by splash's backward kernels given the whole rows' output and
  log-sum-exp, key and value gradients carried round the ring to their device. Output and gradients equal the
  one-device XLA kernel's, with GQA and packed segments crossing slices (a row whose segment begins in a later
  device's slice, a padded tail). Mutations: the key/value gradients left on the device of the last step, or the
  own block's log-sum-exp instead of the whole rows' in the backward pass, fail it."""
  rs = np.random.RandomState(3)
  length = block * 4
  q = rs.normal(size=(2, length, 4, 64)).astype(np.float32)
  k, v = (rs.normal(size=(2, length, 2, 64)).astype(np.float32) for _ in range(2))
  segments = np.ones((2, length), np.int32)
  segments[0, 100 : length // 2 + 30] = 2
  segments[1, length - 70 :] = 0
  calls = []
  kernel_gradients = attention_lib.splash_block_gradients
  monkeypatch.setattr(
    attention_lib,
    "splash_block_gradients",
    lambda kernel, q, *a: calls.append(q.shape[3]) or kernel_gradients(kernel, q, *a),
  )
  split = functools.partial(split_attention, strategy=strategy, interpret=True)
  _, grads = split_equals_one_device(split, dict(data=2, fsdp=1, context=4, tensor=1), q, k, v, segments, atol=2e-5)
  for got in grads:
    assert {shard.data.shape[1] for shard in got.addressable_shards} == {length // 4}
  # One backward product per forward product (query rows each): the ring's 4 blocks, or zigzag's own block and two
  # half blocks a step after it.
  assert calls == ([block] * 4 if strategy == "ring" else [block] + [block // 2] * 6)


def test_a_context_axis_that_does_not_divide_the_sequence_is_one_line():
  with pytest.raises(ConfigError, match=r"mesh.context=3 must divide train.seq_len=32"):
    run_config_lib.run_config_from(run_config(dict(fsdp=1, context=3)))
  with pytest.raises(ConfigError, match=r"zigzag' needs 2 × mesh.context=64 to divide train.seq_len=32"):
    run_config_lib.run_config_from(run_config(dict(fsdp=1, context=32), context_strategy="zigzag"))
  with pytest.raises(ConfigError, match=r"model.attention='cudnn' cannot run inside a context slice .*cuDNN's causal"):
    run_config_lib.run_config_from(run_config(dict(fsdp=1, context=2), attention="cudnn"))
  for strategy in STRATEGIES:  # splash on TPU inside every strategy's slices
    run_config_lib.run_config_from(run_config(dict(fsdp=1, context=2), attention="splash", context_strategy=strategy))
  with pytest.raises(ConfigError, match=r"context_strategy must be one of all_gather, ring, zigzag; got 'ulysses'"):
    ModelConfig(context_strategy="ulysses")


@pytest.mark.parametrize("mesh", [dict(data=1, fsdp=1, context=8, tensor=1), dict(data=2, fsdp=1, context=4, tensor=1)])
def test_the_zigzag_layout_gives_device_i_chunks_i_and_2n_minus_1_minus_i_and_its_inverse_restores_the_order(mesh):
  shards = mesh["context"]
  tokens = np.arange(4 * 32).reshape(4, 32) % 32
  axes = ("activation_batch", "activation_length")
  device_mesh = sharding.make_mesh(mesh)
  with sharding.activate(device_mesh, RULES):
    placed = shard_batch(tokens, device_mesh, RULES, axes)
    zig = jax.jit(lambda x: context_lib.to_zigzag(x, axes))(placed)
    back = jax.jit(lambda x: context_lib.from_zigzag(x, axes))(zig)
  half = 32 // (2 * shards)
  chunks = [list(range(c * half, (c + 1) * half)) for c in range(2 * shards)]
  expected = sum((chunks[i] + chunks[2 * shards - 1 - i] for i in range(shards)), [])
  np.testing.assert_array_equal(np.asarray(zig), np.broadcast_to(expected, tokens.shape))
  np.testing.assert_array_equal(np.asarray(back), tokens)
  assert {shard.data.shape[1] for shard in zig.addressable_shards} == {32 // shards}  # still split, never gathered


def test_zigzag_computes_n_plus_1_of_the_ring_s_2n_blocks_of_scores():
  """On context=4 the ring computes all 4 blocks of every device's row of the [T, T] scores (the masked ones too);
  zigzag its own block and then half a block per step: (4 + 1) / 8 of the ring's work, by the compiler's count of
  the forward's FLOPs (unchunked: XLA's cost analysis counts a loop's body once)."""
  rs = np.random.RandomState(2)
  q = rs.normal(size=(2, 512, 4, 16)).astype(np.float32)
  k, v = (rs.normal(size=(2, 512, 2, 16)).astype(np.float32) for _ in range(2))
  mesh = sharding.make_mesh(dict(data=2, fsdp=1, context=4, tensor=1))
  flops = {}
  with sharding.activate(mesh, RULES):
    placed = [
      shard_batch(x, mesh, RULES, ("activation_batch", "activation_length", axis, None))
      for x, axis in ((q, "activation_heads"), (k, "activation_kv_heads"), (v, "activation_kv_heads"))
    ]
    for strategy in ("ring", "zigzag"):
      kernel = functools.partial(context_lib.context_attention, strategy=strategy)
      cost = jax.jit(kernel).lower(*placed).compile().cost_analysis()
      flops[strategy] = (cost[0] if isinstance(cost, list) else cost)["flops"]
  assert flops["zigzag"] / flops["ring"] == pytest.approx(5 / 8, rel=0.05), flops
