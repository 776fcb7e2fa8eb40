"""On 8 simulated devices: training steps under every mesh equal one device's, FSDP splits the state 8 ways, a
checkpoint saved under one mesh continues identically under another, and bad meshes fail before compilation."""

import jax
import numpy as np
import pytest

from llama_jax.analysis import train_plan as plan_lib
from llama_jax.checkpoint import train_state as checkpoint_lib
from llama_jax.core import model_config as model_config_lib
from llama_jax.core import run_config as run_config_lib
from llama_jax.model import sharding
from llama_jax.training.trainer import Trainer

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")
MESHES = {
  "data8": dict(data=8, fsdp=1, tensor=1),
  "fsdp8": dict(data=1, fsdp=8, tensor=1),
  "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2),
  "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
  "data2_tensor4": dict(data=2, fsdp=1, tensor=4),
}
STEPS = 5


def run_config(mesh: dict, **train):
  cfg = run_config_lib.base_run_config()
  cfg.model.update(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, multiple_of=32, max_seq_len=64, scan_layers=True
  )
  cfg.mesh.update(**mesh)
  cfg.train.update(batch_size=8, seq_len=32, steps=STEPS * 2, warmup_steps=2, lr=1e-3, **train)
  cfg.seed = 7
  return cfg


BATCHES = [
  dict(inputs=t[:, :-1], targets=t[:, 1:])
  for t in np.random.RandomState(0).randint(0, 256, (STEPS * 2, 8, 33)).astype(np.int32)
]


def make_trainer(mesh_cfg, devices=None):
  cfg = run_config(mesh_cfg)
  return Trainer(model_config_lib.model_config_from(cfg), cfg, sharding.make_mesh(cfg.mesh, devices))


def run_steps(trainer, state, batches):
  losses = []
  for batch in batches:
    state, metrics = trainer.train_step(state, trainer.global_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.fixture(scope="module")
def one_device():
  trainer = make_trainer(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  state, losses = run_steps(trainer, trainer.init_state(), BATCHES[:STEPS])
  return losses, jax.tree.map(np.asarray, state["params"])


@pytest.mark.parametrize("mesh_name", ["data8", "fsdp8", "fsdp4_tensor2", "data2_fsdp2_tensor2"])
def test_five_steps_under_each_mesh_match_one_device(one_device, mesh_name):
  losses_1, params_1 = one_device
  trainer = make_trainer(MESHES[mesh_name])
  state, losses = run_steps(trainer, trainer.init_state(), BATCHES[:STEPS])
  np.testing.assert_allclose(losses, losses_1, rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(b), a, atol=1e-5, rtol=1e-5), params_1, state["params"]
  )


def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state_per_device():
  trainer = make_trainer(MESHES["fsdp8"])
  state = trainer.init_state()
  for part in ("params", "opt_state"):
    leaves = jax.tree.leaves(state[part])
    total = sum(a.nbytes for a in leaves)
    for device in jax.devices():
      held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)
      assert abs(held - total / 8) <= 0.05 * total / 8, (part, held, total)


@pytest.fixture(scope="module")
def saved_under_fsdp8(tmp_path_factory):
  """3 steps under fsdp=8, a checkpoint, then 3 more: the losses any mesh must reproduce from the checkpoint."""
  workdir = str(tmp_path_factory.mktemp("reshard"))
  trainer = make_trainer(MESHES["fsdp8"])
  state, _ = run_steps(trainer, trainer.init_state(), BATCHES[:3])
  checkpointer = checkpoint_lib.TrainCheckpointer(workdir)
  checkpointer.save(3, state, {"next_index": 3})
  checkpointer.close()
  _, losses = run_steps(trainer, state, BATCHES[3:6])
  return workdir, losses


@pytest.mark.parametrize("mesh_name", ["data2_tensor4", "one_device"])
def test_checkpoint_saved_under_fsdp8_continues_identically_under_another_mesh(saved_under_fsdp8, mesh_name):
  workdir, expected = saved_under_fsdp8
  if mesh_name == "one_device":
    trainer = make_trainer(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  else:
    trainer = make_trainer(MESHES[mesh_name])
  checkpointer = checkpoint_lib.TrainCheckpointer(workdir)
  state, data_state = checkpointer.restore(checkpointer.latest_step(), trainer.abstract_state())
  checkpointer.close()
  assert int(state["step"]) == 3 and data_state == {"next_index": 3}
  # Restored straight into the new layout.
  wq = state["params"]["layers"]["attention"]["wq"]
  assert wq.sharding == trainer.state_shardings["params"]["layers"]["attention"]["wq"]
  _, losses = run_steps(trainer, state, BATCHES[3:6])
  np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_bad_meshes_fail_before_compilation_naming_the_numbers():
  with pytest.raises(sharding.ShardingError, match=r"2×2×1×1×4 = 16 devices, but 8 devices are available"):
    make_trainer(dict(data=2, fsdp=2, tensor=4))
  with pytest.raises(
    sharding.ShardingError,
    match=r"axis 2 \('kv_heads'\) of size 4 is not divisible by mesh axes "
    r"tensor = 8",
  ):
    make_trainer(dict(data=1, fsdp=1, tensor=8))
  cfg = run_config(dict(data=4, fsdp=2, tensor=1))
  cfg.train.batch_size = 12
  with pytest.raises(
    sharding.ShardingError,
    match=r"batch of 12 sequences .* not divisible by the 8 batch shards "
    r"\(mesh data=4×fsdp=2×expert=1\)",
  ):
    Trainer(model_config_lib.model_config_from(cfg), cfg, sharding.make_mesh(cfg.mesh))
  with pytest.raises(sharding.ShardingError, match="mesh.dcn_data is 2 but the devices form 1 processes"):
    sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1, dcn_data=2))


def test_planner_parameter_bytes_are_params_times_dtype_size_over_shards():
  cfg = run_config(MESHES["fsdp8"])
  result = plan_lib.plan(cfg)
  model = model_config_lib.model_config_from(cfg)
  norms = (2 * model.n_layers + 1) * model.dim  # norm scales are replicated
  assert result.params_bytes == (model.num_params() - norms) * 4 // 8 + norms * 4
  assert result.opt_state_bytes == 2 * result.params_bytes + 2 * 4  # mu, nu (+ two int32 step counts)
  # The compiled step's arguments are exactly that state and the batch (+ step and RNG key).
  assert result.argument_bytes == result.params_bytes + result.opt_state_bytes + result.batch_bytes + 4 + 8
  assert result.batch_bytes == 2 * (8 // 8) * 32 * 4  # inputs, targets: one sequence per device
  assert result.alias_bytes > 0 and result.temp_bytes > 0
