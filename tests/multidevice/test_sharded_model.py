"""On 8 simulated devices: sharded logits and gradients equal one device's, and FSDP really splits parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
from llama_jax.model import sharding
from llama_jax.model.llama import Llama

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")
RULES = DEFAULT_LOGICAL_AXIS_RULES
CFG = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=32, max_seq_len=64)
MESHES = {
  "data8": dict(data=8, fsdp=1, tensor=1),
  "fsdp8": dict(data=1, fsdp=8, tensor=1),
  "fsdp2_tensor4": dict(data=1, fsdp=2, tensor=4),
  "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
}


def loss_fn(params, graphdef, tokens):
  logits = nnx.merge(graphdef, params)(tokens[:, :-1])
  targets = tokens[:, 1:]
  loss = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])
  return loss, logits


def shard_batch(batch, mesh, rules, logical_axes=("activation_batch", "activation_length")):
  """Places host arrays [B, T, ...] on the mesh with the batch axis split as the activation rules say."""
  spec = sharding.logical_to_spec(logical_axes, rules)
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, spec)), batch)


def logits_and_grads(model, mesh, tokens):
  graphdef, params = nnx.split(model)
  with sharding.activate(mesh, RULES):
    tokens = shard_batch(tokens, mesh, RULES)
    (_, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)(params, graphdef, tokens)
  return logits, grads


@pytest.fixture(scope="module")
def reference():
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  model = sharding.init_model(Llama, CFG, mesh, RULES, seed=3)
  tokens = np.random.RandomState(0).randint(0, CFG.vocab_size, (8, 33))
  logits, grads = logits_and_grads(model, mesh, tokens)
  return model, tokens, np.asarray(logits), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.mark.parametrize("mesh_name", MESHES)
def test_sharded_logits_and_grads_equal_one_device(reference, mesh_name):
  model_1, tokens, logits_1, grads_1 = reference
  mesh = sharding.make_mesh(MESHES[mesh_name])
  model = sharding.init_model(Llama, CFG, mesh, RULES, seed=3)
  # Sharded initialisation draws the same numbers as one device: the same random bits, then elementwise float maths
  # compiled for another mesh (equal to rounding; a different stream would differ everywhere).
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
    nnx.to_pure_dict(nnx.state(model_1)),
    nnx.to_pure_dict(nnx.state(model)),
  )
  logits, grads = logits_and_grads(model, mesh, tokens)
  np.testing.assert_allclose(np.asarray(logits), logits_1, atol=1e-5, rtol=0)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(b), a, atol=1e-5, rtol=1e-5), grads_1, nnx.to_pure_dict(grads)
  )
  # The activation constraints were applied: logits are split over the batch as the rules say.
  batch_shards = MESHES[mesh_name]["data"] * MESHES[mesh_name]["fsdp"]
  assert logits.addressable_shards[0].data.shape[0] == 8 // batch_shards


def test_fsdp8_shards_every_large_parameter_eight_ways():
  mesh = sharding.make_mesh(MESHES["fsdp8"])
  model = sharding.init_model(Llama, CFG, mesh, RULES)
  params = nnx.to_pure_dict(nnx.state(model))
  large = [(path, a) for path, a in jax.tree_util.tree_leaves_with_path(params) if "scale" not in str(path)]
  assert len(large) == 9  # embed, lm_head, 4 attention and 3 mlp matrices
  for path, array in large:
    assert isinstance(array.sharding, NamedSharding)
    for shard in array.addressable_shards:
      assert shard.data.size * 8 == array.size, jax.tree_util.keystr(path)


def test_tensor_axis_not_dividing_kv_heads_is_rejected_before_init():
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=8))
  with pytest.raises(
    sharding.ShardingError,
    match=r"layers/attention/wk .* axis 2 \('kv_heads'\) of size 4 is not "
    r"divisible by mesh axes tensor = 8",
  ):
    sharding.init_model(Llama, CFG, mesh, RULES)


def test_minus_one_takes_the_remaining_devices():
  assert sharding.make_mesh(dict(data=2, fsdp=-1, tensor=2)).shape == {
    "data": 2,
    "fsdp": 2,
    "expert": 1,
    "context": 1,
    "tensor": 2,
  }
