"""Model FLOPs and the peak they are measured against: MFU in the training log and the memory planner."""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp

from llama_jax.core import accelerators
from llama_jax.core.model_config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3 × forward): 6 per matmul weight, plus attention's QKᵀ and PV
  (counted in full, as PaLM's MFU does, though the causal half is masked). A mixture of experts counts the top_k
  experts a token runs and its router: the model's FLOPs, whichever path computes them (the dense reference runs all
  experts; the capacity path pads)."""
  d, h = cfg.dim, cfg.head_dim
  per_layer = d * h * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.hidden_dim  # a dense block
  moe_extra = 3 * d * cfg.hidden_dim * (cfg.moe.top_k - 1) + d * cfg.moe.num_experts  # top_k experts + router
  matmul_weights = cfg.n_layers * per_layer + cfg.n_moe_layers * moe_extra + cfg.vocab_size * d  # + the LM head
  return 6.0 * matmul_weights + 12.0 * cfg.n_layers * cfg.n_heads * h * seq_len


def peak_flops_per_device(configured: float) -> float:
  """`configured` when set, else the device kind's entry in the accelerator table, else a measured float32 matmul
  (CPU)."""
  if configured:
    return configured
  accelerator = accelerators.by_device_kind(jax.devices()[0].device_kind)
  return accelerator.peak_flops if accelerator is not None else measured_matmul_flops()


@functools.lru_cache(maxsize=1)
def measured_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
  """A float32 matmul's FLOP/s on this device: the peak MFU is quoted against on CPU."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best
