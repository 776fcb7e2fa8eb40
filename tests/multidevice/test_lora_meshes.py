"""On 8 simulated devices: LoRA steps under sharded meshes equal one device's, each adapter is split like the input and
output axes of its base weight (the rank axis never), and the frozen base keeps its own sharding."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import model_config as model_config_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.training.trainer import Trainer
from tests.multidevice.test_training_meshes import BATCHES, MESHES, run_config, run_steps

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")
STEPS = 3


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  cfg = model_config_lib.model_config_from(run_config(MESHES["fsdp8"]))
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(3))))
  directory = str(tmp_path_factory.mktemp("lora_base") / "base")
  checkpoint_params.save_params_dir(directory, cfg, jax.tree.map(np.asarray, params))
  return directory


def lora_trainer(base_dir, mesh, devices=None):
  cfg = run_config(mesh)
  cfg.train.lora.update(rank=4, alpha=8.0)
  cfg.init_from = base_dir
  trainer = Trainer(model_config_lib.model_config_from(cfg), cfg, sharding.make_mesh(cfg.mesh, devices))
  trainer.load_frozen(base_dir)
  return trainer


@pytest.fixture(scope="module")
def one_device(base_dir):
  trainer = lora_trainer(base_dir, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  state, losses = run_steps(trainer, trainer.init_state(), BATCHES[:STEPS])
  return losses, jax.tree.map(np.asarray, state["params"])


@pytest.mark.parametrize("mesh_name", ["fsdp8", "data2_fsdp2_tensor2"])
def test_lora_steps_under_a_sharded_mesh_match_one_device(base_dir, one_device, mesh_name):
  losses_1, adapters_1 = one_device
  trainer = lora_trainer(base_dir, MESHES[mesh_name])
  state, losses = run_steps(trainer, trainer.init_state(), BATCHES[:STEPS])
  assert np.abs(np.asarray(state["params"]["layers"]["mlp"]["w_up_lora_b"])).max() > 0  # B left zeros: it trained
  np.testing.assert_allclose(losses, losses_1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), a, atol=1e-6), adapters_1, state["params"])


def test_adapters_follow_their_base_weights_sharding(base_dir):
  trainer = lora_trainer(base_dir, MESHES["fsdp4_tensor2"])
  state = trainer.init_state()
  attention, mlp = state["params"]["layers"]["attention"], state["params"]["layers"]["mlp"]
  base_attention = trainer.frozen["base"]["layers"]["attention"]
  # wq [L, D, N, H] is (layers, embed→fsdp, heads→tensor, head_dim): A [L, D, R] takes the input axes, B [L, R, N, H]
  # the output axes.
  assert base_attention["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
  assert attention["wq_lora_a"].sharding.spec == P(None, "fsdp", None)
  assert attention["wq_lora_b"].sharding.spec == P(None, None, "tensor", None)
  # wo [L, N, H, D]: A [L, N, H, R] sharded over heads, B [L, R, D] over embed; w_down [L, F, D] alike.
  assert attention["wo_lora_a"].sharding.spec == P(None, "tensor", None, None)
  assert attention["wo_lora_b"].sharding.spec == P(None, None, "fsdp")
  assert mlp["w_down_lora_a"].sharding.spec == P(None, "tensor", None)
  a = attention["wq_lora_a"]
  assert {s.data.shape for s in a.addressable_shards} == {(a.shape[0], a.shape[1] // 4, a.shape[2])}
