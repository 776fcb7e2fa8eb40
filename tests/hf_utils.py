"""Reference models for the tests: HF transformers LlamaForCausalLM and MixtralForCausalLM with random weights, built
offline."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from safetensors import safe_open

from llama_jax.core.model_config import ModelConfig
from llama_jax.interop import hf as hf_lib
from llama_jax.interop import hf_config as hf_config_lib
from llama_jax.model import lora as lora_lib


def hf_config(cfg: ModelConfig) -> transformers.LlamaConfig:
  hf = transformers.LlamaConfig.from_dict(hf_config_lib.hf_config_from_model_config(cfg))
  hf._attn_implementation = "eager"  # the plain softmax(QKᵀ)V reference
  return hf


def random_hf_model(cfg: ModelConfig, seed: int = 0) -> transformers.LlamaForCausalLM:
  """Random weights at HF's init scale; norm scales are randomised too so that they are tested."""
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  return model


def hf_tensors(model: transformers.LlamaForCausalLM) -> dict[str, np.ndarray]:
  return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}


def params_of(model: transformers.LlamaForCausalLM, cfg: ModelConfig):
  return hf_lib.params_from_hf(hf_tensors(model), cfg)


def adapters_from_peft(tensors, cfg: ModelConfig, lora) -> dict:
  """Stacked adapters (llama_jax's layout) from peft's tensors: the inverse of ``interop.peft.peft_tensors``, to load
  peft's own adapters into a llama_jax model."""
  shapes = lora_lib.weight_shapes(cfg)
  out: dict = {"layers": {}}
  for name in lora.targets:
    group, n_in = lora_lib.TARGETS[name]
    module = hf_lib.HF_MODULES[name]
    in_shape, out_shape = shapes[name][:n_in], shapes[name][n_in:]
    a = np.stack([tensors[f"base_model.model.model.layers.{i}.{module}.lora_A.weight"].T for i in range(cfg.n_layers)])
    b = np.stack([tensors[f"base_model.model.model.layers.{i}.{module}.lora_B.weight"].T for i in range(cfg.n_layers)])
    node = out["layers"].setdefault(group, {})
    node[name + lora_lib.A_SUFFIX] = a.reshape(cfg.n_layers, *in_shape, lora.rank).astype(np.float32)
    node[name + lora_lib.B_SUFFIX] = b.reshape(cfg.n_layers, lora.rank, *out_shape).astype(np.float32)
  return out


def random_hf_mixtral(cfg: ModelConfig, seed: int = 0) -> transformers.MixtralForCausalLM:
  """transformers' Mixtral with random weights (norm scales randomised too), eager attention."""
  torch.manual_seed(seed)
  hf = transformers.MixtralConfig.from_dict(hf_config_lib.hf_config_from_model_config(cfg))
  hf._attn_implementation = "eager"
  model = transformers.MixtralForCausalLM(hf).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  return model


def saved_tensors(model: transformers.PreTrainedModel, directory) -> dict[str, np.ndarray]:
  """The tensors `save_pretrained` writes (for Mixtral, the published per-expert layout, not the fused one
  transformers ≥ 5 holds in memory), read back from its safetensors file."""
  model.save_pretrained(directory)
  return saved_tensors_in(directory)


def saved_tensors_in(directory) -> dict[str, np.ndarray]:
  with safe_open(f"{directory}/model.safetensors", "np") as f:
    return {name: f.get_tensor(name) for name in f.keys()}
