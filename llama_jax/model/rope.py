"""Rotary position embedding (RoPE) and its frequency scalings (linear; Llama 3's long-context "llama3").

Layout: the HF transformers convention (rotate the two *halves* of each head, ``rotate_half``), so HF Llama weights
load without any permutation. Meta's original checkpoints rotate *interleaved pairs*; their wq/wk rows must be
permuted on the way in (see ``interop.meta.permute_meta_qk``). Axis letters: llama.py's legend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama_jax.core.model_config import ModelConfig

Array = jax.Array


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies θ^(-2i/H) of each rotated pair, with linear or llama3 context scaling applied."""
  head_dim = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if cfg.rope_scaling == "linear":
    inv_freq = inv_freq / cfg.rope_scaling_factor
  elif cfg.rope_scaling == "llama3":
    # Long wavelengths are stretched by the factor, short ones kept, and the band between blended smoothly.
    factor = cfg.rope_scaling_factor
    low_freq_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_freq_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
      cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(is_medium, blended, scaled)
  return inv_freq.astype(np.float32)


class RotaryEmbedding(nnx.Module):
  """Rotates each head's two halves by position-dependent angles (HF `rotate_half` layout); no parameters."""

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  def __call__(self, x: Array, positions_BT: Array) -> Array:
    """`x` [B, T, heads, H] rotated by `positions_BT`: the queries (N heads) and the keys (K heads) alike."""
    inv_freq = jnp.asarray(rope_inverse_frequencies(self.cfg))
    # Angles in float32: bf16 positions × frequencies lose whole radians past a few hundred tokens.
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
