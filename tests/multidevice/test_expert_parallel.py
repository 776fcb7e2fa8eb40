"""On 8 simulated devices: a mixture of experts with its experts sharded over the `expert` mesh axis (tokens sent to
their experts' devices by all-to-all) gives one device's loss and gradients, composed with data, fsdp and tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax.core import run_config as run_config_lib
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
from llama_jax.model import loss as loss_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.training.trainer import Trainer
from tests.multidevice.test_sharded_model import shard_batch

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")
RULES = DEFAULT_LOGICAL_AXIS_RULES
MOE = dict(num_experts=8, top_k=2, z_loss_weight=1e-3)
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64, moe=MOE)
MESHES = {
  "expert8": dict(data=1, fsdp=1, expert=8, tensor=1),
  "expert4_fsdp2": dict(data=1, fsdp=2, expert=4, tensor=1),
  "expert2_tensor2_data2": dict(data=2, fsdp=1, expert=2, tensor=2),
}
TOL = 1e-5


def batch_of(seed=0):
  """Packed rows with padding: the router statistics must skip the same tokens on every mesh."""
  rs = np.random.RandomState(seed)
  tokens = rs.randint(0, CFG.vocab_size, (8, 33))
  segment_ids = np.ones((8, 32), np.int32)
  segment_ids[1, 20:] = 2
  segment_ids[3, 25:] = 0
  return dict(
    inputs=tokens[:, :-1],
    targets=tokens[:, 1:],
    segment_ids=segment_ids,
    weights=(segment_ids != 0).astype(np.float32),
  )


def loss_and_grads(cfg, mesh, params, batch):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))

  def objective(p, b):
    losses, weights, terms = loss_lib.losses_and_router(p, graphdef, b)
    return jnp.sum(losses * weights) / jnp.sum(weights) + terms["objective"], terms

  with sharding.activate(mesh, RULES):
    batch = shard_batch(batch, mesh, RULES)
    params = jax.device_put(params, sharding.shardings_of(sharding.abstract_params(Llama, cfg, mesh, RULES)[1]))
    step = jax.jit(jax.value_and_grad(objective, has_aux=True))
    hlo = step.lower(params, batch).compile().as_text()
    (loss, terms), grads = step(params, batch)
  # Expert parallelism exchanges tokens by all-to-all (in the layer scan's forward and backward bodies, some of them
  # merged by XLA); one device has none.
  assert (hlo.count("all-to-all(") >= 2) == (dict(mesh.shape)["expert"] > 1), hlo.count("all-to-all(")
  return float(loss), jax.tree.map(np.asarray, terms), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def reference():
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  model = sharding.init_model(Llama, CFG, mesh, RULES, seed=3)
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  return params, loss_and_grads(CFG, mesh, params, batch_of())


@pytest.mark.parametrize("compute", ["dropless", "capacity"])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_expert_parallel_loss_and_gradients_equal_one_device(reference, mesh_name, compute):
  """capacity: capacity_factor = the expert count, so no device's send buffer overflows and nothing is dropped
  (the dropping itself is tested against its own reference in tests/model/test_moe.py)."""
  params, (loss_1, terms_1, grads_1) = reference
  cfg = CFG.replace(moe=dict(MOE, compute=compute, capacity_factor=8.0))
  mesh = sharding.make_mesh(MESHES[mesh_name])
  loss, terms, grads = loss_and_grads(cfg, mesh, params, batch_of())
  assert loss == pytest.approx(loss_1, rel=TOL)
  assert float(terms["moe_balance"]) == pytest.approx(float(terms_1["moe_balance"]), rel=TOL)
  if compute == "capacity":
    assert float(terms["moe_dropped"]) == 0.0
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1)):
    scale = max(float(np.abs(expected).max()), 1.0)
    assert np.abs(got - expected).max() <= TOL * scale, jax.tree_util.keystr(path)


def test_moe_every_second_block_on_expert4_fsdp2_equals_one_device():
  """moe.every=2 over 4 layers (blocks 1 and 3 mixtures): the grouped layer scan sharded with experts over `expert`
  and the dense blocks' weights over fsdp gives one device's loss, balance loss and gradients."""
  cfg = CFG.replace(n_layers=4, moe=dict(MOE, every=2))
  one = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(sharding.init_model(Llama, cfg, one, RULES, seed=5))))
  assert set(params["layers"]) == {"blocks"}
  loss_1, terms_1, grads_1 = loss_and_grads(cfg, one, params, batch_of(1))
  loss, terms, grads = loss_and_grads(cfg, sharding.make_mesh(MESHES["expert4_fsdp2"]), params, batch_of(1))
  assert loss == pytest.approx(loss_1, rel=TOL)
  assert float(terms["moe_balance"]) == pytest.approx(float(terms_1["moe_balance"]), rel=TOL)
  assert sorted(k for k in terms if k.startswith("moe_load/")) == ["moe_load/1", "moe_load/3"]
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1)):
    scale = max(float(np.abs(expected).max()), 1.0)
    assert np.abs(got - expected).max() <= TOL * scale, jax.tree_util.keystr(path)


def test_expert_weights_are_split_over_the_expert_axis():
  mesh = sharding.make_mesh(MESHES["expert4_fsdp2"])
  model = sharding.init_model(Llama, CFG, mesh, RULES)
  w_gate = nnx.state(model)["layers"]["mlp"]["w_gate"][...]
  # [L, E, D, F]: 8 experts over expert=4, the model dim over fsdp=2.
  assert w_gate.addressable_shards[0].data.shape == (2, 2, 32, CFG.hidden_dim)


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_line():
  cfg = CFG.replace(moe=dict(MOE, num_experts=6))
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, expert=4, tensor=1))
  message = r"axis 1 \('expert'\) of size 6 is not divisible by mesh axes expert = 4"
  with pytest.raises(sharding.ShardingError, match=message):
    sharding.init_model(Llama, cfg, mesh, RULES)


def test_training_steps_on_expert4_fsdp2_equal_one_device():
  """The trainer's own step (optimizer, balance losses in the objective, expert loads in the metrics) on an
  expert × fsdp mesh: the same losses and parameters as on one device."""
  cfg = run_config_lib.base_run_config()
  cfg.model.update(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)
  cfg.model.moe.update(**MOE)
  cfg.train.update(batch_size=8, seq_len=32, steps=10, warmup_steps=2, lr=1e-2)
  batches = [dict(inputs=t[:, :-1], targets=t[:, 1:]) for t in np.random.RandomState(0).randint(0, 256, (3, 8, 33))]
  results = []
  for mesh, devices in ((dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]), (MESHES["expert4_fsdp2"], None)):
    cfg.mesh.update(**mesh)
    run_config = run_config_lib.run_config_from(cfg)
    trainer = Trainer(run_config.model, run_config, sharding.make_mesh(run_config.mesh, devices))
    state, losses = trainer.init_state(), []
    for batch in batches:
      state, metrics = trainer.train_step(state, trainer.global_batch(batch))
      losses.append(float(metrics["loss"]))
      assert [np.asarray(metrics[f"moe_load/{layer}"]).shape for layer in range(2)] == [(8,), (8,)]
    results.append((losses, jax.tree.map(np.asarray, state["params"])))
  (losses_1, params_1), (losses_8, params_8) = results
  np.testing.assert_allclose(losses_8, losses_1, rtol=TOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4), params_1, params_8)
