"""Reference models for the tests: HF transformers LlamaForCausalLM with random weights, built offline."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from llama_jax import convert
from llama_jax.config import ModelConfig


def hf_config(cfg: ModelConfig) -> transformers.LlamaConfig:
  hf = transformers.LlamaConfig.from_dict(convert.hf_config_from_model_config(cfg))
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
  return convert.params_from_hf(hf_tensors(model), cfg)
