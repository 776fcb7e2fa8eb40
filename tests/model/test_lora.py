"""LoRA against HF peft: the same base and adapter weights give the same logits (MHA and GQA), an exported peft
adapter loads in peft, merged weights equal base + adapter, and the adapter maths (init, merge) is peft's."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
from flax import nnx

from llama_jax.core import paths
from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import LORA_TARGETS
from llama_jax.core.run_config import LoraConfig
from llama_jax.interop import peft as peft_export
from llama_jax.interop.hf import HF_MODULES
from llama_jax.model import llama as model_lib
from llama_jax.model import lora as lora_lib
from tests import hf_utils
from tests.model.test_llama import load, small_config

torch.set_num_threads(2)
# float32 logits through two layers: the dense and low-rank products are summed in a different order than torch's.
TOL = 1e-5


def peft_model(cfg, lora: LoraConfig, seed: int = 0):
  """HF LlamaForCausalLM with random weights wrapped by peft, its adapters random too (B is zeros at init, which
  would test nothing)."""
  base = hf_utils.random_hf_model(cfg, seed)
  base_params = hf_utils.params_of(base, cfg)
  modules = sorted(HF_MODULES[t].split(".")[-1] for t in lora.targets)
  config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=modules, lora_dropout=0.0)
  model = peft.get_peft_model(base, config).eval()
  torch.manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(0.1 * torch.randn_like(p))
  return model, base_params


def peft_adapter_tensors(model) -> dict[str, np.ndarray]:
  """The adapter tensors as peft saves them (adapter_model.safetensors names)."""
  return {name: t.detach().numpy().copy() for name, t in peft.get_peft_model_state_dict(model).items()}


def ours_with_adapters(cfg, lora: LoraConfig, base_params, adapters) -> model_lib.Llama:
  abstract = nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), lora=lora))
  return load(abstract, lora_lib.combine(base_params, adapters))


def logits_of_peft(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


CASES = {
  "mha, every projection": (dict(n_kv_heads=4), LoraConfig(rank=4, alpha=8.0)),
  "gqa, attention only": (dict(n_kv_heads=2), LoraConfig(rank=8, alpha=16.0, targets=("wq", "wk", "wv", "wo"))),
  "gqa, mlp only, alpha ≠ rank": (dict(n_kv_heads=1), LoraConfig(rank=2, alpha=5.0, targets=("w_gate", "w_down"))),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_peft_on_the_same_base_and_adapters(case):
  model_changes, lora = CASES[case]
  cfg = small_config(**model_changes)
  model, base_params = peft_model(cfg, lora)
  adapters = hf_utils.adapters_from_peft(peft_adapter_tensors(model), cfg, lora)
  ours = ours_with_adapters(cfg, lora, base_params, adapters)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 32))
  expected = logits_of_peft(model, tokens)
  got = np.asarray(ours(jnp.asarray(tokens)))
  diff = np.abs(got - expected).max()
  # The adapters must matter: the base alone is far from peft's output.
  base_only = np.asarray(load(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))), base_params)(tokens))
  assert np.abs(base_only - expected).max() > 100 * TOL
  print(f"{case}: max abs logits diff {diff:.2e}")
  assert diff <= TOL


@pytest.mark.parametrize("case", CASES)
def test_merged_weights_equal_base_plus_adapter_and_peft_merge(case):
  model_changes, lora = CASES[case]
  cfg = small_config(**model_changes)
  model, base_params = peft_model(cfg, lora)
  adapters = hf_utils.adapters_from_peft(peft_adapter_tensors(model), cfg, lora)
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 24))
  with_adapters = np.asarray(ours_with_adapters(cfg, lora, base_params, adapters)(jnp.asarray(tokens)))
  merged = lora_lib.merge(base_params, adapters, lora.scale)
  assert jax.tree.structure(merged) == jax.tree.structure(base_params)
  plain = load(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))), merged)
  assert np.abs(np.asarray(plain(jnp.asarray(tokens))) - with_adapters).max() <= TOL
  # peft's own merge gives the same weights (HF layout) as ours.
  peft_merged = hf_utils.params_of(model.merge_and_unload(), cfg)
  for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(peft_merged)):
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_exported_peft_adapter_loads_in_peft_with_the_same_logits(tmp_path):
  cfg, lora = small_config(n_kv_heads=2), LoraConfig(rank=4, alpha=8.0)
  model, base_params = peft_model(cfg, lora)
  adapters = hf_utils.adapters_from_peft(peft_adapter_tensors(model), cfg, lora)
  out = tmp_path / "adapter"
  out.mkdir()
  safetensors.numpy.save_file(peft_export.peft_tensors(adapters, cfg), str(out / "adapter_model.safetensors"))
  (out / "adapter_config.json").write_text(json.dumps(peft_export.peft_config(lora, "base")))
  fresh_base = hf_utils.random_hf_model(cfg, seed=0)  # the same base weights, no adapters
  loaded = peft.PeftModel.from_pretrained(fresh_base, str(out)).eval()
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (1, 20))
  np.testing.assert_allclose(logits_of_peft(loaded, tokens), logits_of_peft(model, tokens), atol=1e-6)


def test_adapters_start_as_peft_does_and_change_nothing_at_init():
  cfg, lora = small_config(), LoraConfig(rank=4)
  ours = nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), lora=lora))
  _, abstract_adapters = lora_lib.split(nnx.to_pure_dict(nnx.state(ours)))
  names = {path[-1].key for path, _ in jax.tree_util.tree_leaves_with_path(abstract_adapters)}
  assert names == {t + s for t in LORA_TARGETS for s in (lora_lib.A_SUFFIX, lora_lib.B_SUFFIX)}
  real = model_lib.Llama(cfg, rngs=nnx.Rngs(0), lora=lora)
  base, adapters = lora_lib.split(nnx.to_pure_dict(nnx.state(real)))
  a, b = adapters["layers"]["attention"]["wq_lora_a"], adapters["layers"]["attention"]["wq_lora_b"]
  assert a.shape == (cfg.n_layers, cfg.dim, 4) and b.shape == (cfg.n_layers, 4, cfg.n_heads, cfg.head_dim)
  assert a.dtype == b.dtype == jnp.float32
  bound = 1 / np.sqrt(cfg.dim)  # peft: kaiming_uniform(a=√5) on lora_A [rank, in] is uniform in ±1/sqrt(in)
  assert 0.9 * bound < float(jnp.abs(a).max()) <= bound and not np.asarray(b).any()
  wo_a = adapters["layers"]["attention"]["wo_lora_a"]
  assert wo_a.shape == (cfg.n_layers, cfg.n_heads, cfg.head_dim, 4)  # wo's input is all heads
  plain = load(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))), base)
  tokens = jnp.arange(12)[None] % cfg.vocab_size
  np.testing.assert_array_equal(np.asarray(real(tokens)), np.asarray(plain(tokens)))
  assert lora_lib.num_adapter_params(cfg, lora) == sum(x.size for x in jax.tree.leaves(adapters))


@pytest.mark.parametrize(
  "values, message",
  [
    (dict(rank=-1), "train.lora.rank must be ≥ 0, got -1"),
    (dict(rank=4, alpha=0.0), "train.lora.alpha must be > 0, got 0.0"),
    (dict(rank=4, targets=("wq", "lm_head")), "train.lora.targets must be distinct names from wq, wk"),
    (dict(rank=4, targets=()), "train.lora.targets must be distinct names"),
    (dict(rank=4, targets=("wq", "wq")), "train.lora.targets must be distinct names"),
  ],
)
def test_bad_lora_settings_are_one_line(values, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
    LoraConfig(**values)
  assert "\n" not in str(e.value)


def test_peft_tensor_names_cover_every_layer_and_target():
  cfg, lora = small_config(), LoraConfig(rank=2, targets=("wo", "w_up"))
  adapters = lora_lib.split(nnx.to_pure_dict(nnx.state(model_lib.Llama(cfg, rngs=nnx.Rngs(0), lora=lora))))[1]
  tensors = peft_export.peft_tensors(adapters, cfg)
  assert len(tensors) == cfg.n_layers * 2 * 2
  assert tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (2, cfg.dim)
  assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].shape == (cfg.hidden_dim, 2)
  back = hf_utils.adapters_from_peft(tensors, cfg, lora)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(x, np.asarray(y))
  assert os.path.basename(paths.LORA_FILE) == "lora.json"
