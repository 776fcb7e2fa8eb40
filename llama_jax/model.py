"""LLaMA 2 as flax.nnx modules: RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP, Block, Llama.

Axis legend used in every einsum and array name of the package:
  B batch, T query length, S key/value length, N query heads, K kv heads, G = N / K query heads per kv head,
  H head dim, D model dim, F mlp hidden, V vocab, L layers.

Parameters carry logical axis names (see ``config.DEFAULT_LOGICAL_AXIS_RULES``); the mesh mapping lives in the run
config, never here. Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` where they are used;
norms, softmax and logits are computed in float32.

RoPE layout: the HF transformers convention (rotate the two *halves* of each head, ``rotate_half``), so HF Llama
weights load without any permutation. Meta's original checkpoints rotate *interleaved pairs*; their wq/wk rows must be
permuted on the way in (see ``convert.permute_meta_qk``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama_jax import attention as attention_lib
from llama_jax import sharding
from llama_jax.config import ModelConfig

Array = jax.Array


def _param(rngs: nnx.Rngs, shape, logical_axes, cfg: ModelConfig, init=None) -> nnx.Param:
  init = init or jax.nn.initializers.normal(cfg.init_std)
  value = init(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
  # No eager sharding: shardings are applied by the caller (sharding.init_model: abstract init, then jit with
  # out_shardings), so modules can also be built with no mesh at all (tests, conversion).
  return nnx.Param(value, out_sharding=logical_axes, eager_sharding=False)


def project(x: Array, w: Array, *, preferred_element_type=None) -> Array:
  """x[..., I] · w[I, O...] as one 2-D matrix product, for every projection of the model.

  Same numbers as the einsum it replaces (written next to each call), but XLA's CPU backend runs a 2-D dot and its
  weight gradient far faster than the same contraction written over [B, T]: an MLP's forward + backward at B=8,
  T=512, D=512, F=1536 took 416 ms instead of 704 ms. The reshapes are free (contiguous) and keep shardings, since
  the batch stays the major axis.
  """
  lead_shape, out_shape = x.shape[:-1], w.shape[1:]
  y = jnp.dot(x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1), preferred_element_type=preferred_element_type)
  return y.reshape(*lead_shape, *out_shape)


class RMSNorm(nnx.Module):
  """x / rms(x) · scale, with the statistics in float32 (as Meta and HF do) and the result in the input dtype."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.eps = cfg.norm_eps
    self.scale = _param(rngs, (cfg.dim,), ("norm",), cfg, init=jax.nn.initializers.ones)

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


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
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(is_medium, blended, scaled)
  return inv_freq.astype(np.float32)


class RotaryEmbedding(nnx.Module):
  """Rotates each head's two halves by position-dependent angles (HF `rotate_half` layout); no parameters."""

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  def __call__(self, x_BTXH: Array, positions_BT: Array) -> Array:
    inv_freq = jnp.asarray(rope_inverse_frequencies(self.cfg))
    # Angles in float32: bf16 positions × frequencies lose whole radians past a few hundred tokens.
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(angles_BTh)[:, :, None, :]
    sin = jnp.sin(angles_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTXH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTXH.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention: N query heads share K kv heads (G = N / K); kv heads are never repeated."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, k, h = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg)
    self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
    self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
    self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), cfg)
    self.rope = RotaryEmbedding(cfg)

  def __call__(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None,
               cache: LayerCache | None = None) -> tuple[Array, tuple[Array, Array]]:
    """Output [B, T, D] and keys/values: without a cache, this call's rotated keys and values [B, T, K, H], the
    queries attending over this call's tokens only; with one, the updated cache k, v (the layer's own [B, K, S, H]
    buffers, or the stacked [L, B, K, S, H] ones) with the new keys and values at slot `cache.index`, the queries
    attending over every filled slot by position (decoding)."""
    dtype = x_BTD.dtype
    q_BTNH = project(x_BTD, self.wq[...].astype(dtype))  # BTD,DNH->BTNH
    k_BTKH = project(x_BTD, self.wk[...].astype(dtype))  # BTD,DKH->BTKH
    v_BTKH = project(x_BTD, self.wv[...].astype(dtype))  # BTD,DKH->BTKH
    q_BTNH = sharding.constrain(q_BTNH, ("activation_batch", "activation_length", "activation_heads", None))
    k_BTKH = sharding.constrain(k_BTKH, ("activation_batch", "activation_length", "activation_kv_heads", None))
    q_BTNH = self.rope(q_BTNH, positions_BT)
    k_BTKH = self.rope(k_BTKH, positions_BT)
    if cache is None:
      out_BTNH = attention_lib.attention(
          q_BTNH, k_BTKH, v_BTKH, q_segment_ids=segment_ids_BT, kv_segment_ids=segment_ids_BT,
          implementation=self.cfg.attention)
      new_kv = (k_BTKH, v_BTKH)
    else:
      # The T new slots are written in place (the decode loop donates the cache): into the layer's own buffers, or
      # into the stacked cache, whose layer slice is then read for attention.
      k_BKTH = k_BTKH.swapaxes(1, 2).astype(cache.k.dtype)
      v_BKTH = v_BTKH.swapaxes(1, 2).astype(cache.v.dtype)
      if cache.layer is None:
        k_BKSH = jax.lax.dynamic_update_slice(cache.k, k_BKTH, (0, 0, cache.index, 0))
        v_BKSH = jax.lax.dynamic_update_slice(cache.v, v_BKTH, (0, 0, cache.index, 0))
        new_kv = (k_BKSH, v_BKSH)
      else:
        start = (cache.layer, 0, 0, cache.index, 0)
        k_LBKSH = jax.lax.dynamic_update_slice(cache.k, k_BKTH[None], start)
        v_LBKSH = jax.lax.dynamic_update_slice(cache.v, v_BKTH[None], start)
        k_BKSH = jax.lax.dynamic_index_in_dim(k_LBKSH, cache.layer, keepdims=False)
        v_BKSH = jax.lax.dynamic_index_in_dim(v_LBKSH, cache.layer, keepdims=False)
        new_kv = (k_LBKSH, v_LBKSH)
      out_BTNH = attention_lib.cached_attention(q_BTNH, k_BKSH.astype(dtype), v_BKSH.astype(dtype),
                                                q_positions=positions_BT, kv_positions=cache.positions)
    b, t, n, h = out_BTNH.shape
    out_BTD = project(out_BTNH.reshape(b, t, n * h), self.wo[...].astype(dtype).reshape(n * h, -1))  # BTNH,NHD->BTD
    return out_BTD, new_kv


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) · up(x)); the width F follows LLaMA's rule (``ModelConfig.hidden_dim``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.dim, cfg.hidden_dim
    self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), cfg)
    self.w_up = _param(rngs, (d, f), ("embed", "mlp"), cfg)
    self.w_down = _param(rngs, (f, d), ("mlp", "embed"), cfg)

  def __call__(self, x_BTD: Array) -> Array:
    dtype = x_BTD.dtype
    gate_BTF = project(x_BTD, self.w_gate[...].astype(dtype))  # BTD,DF->BTF
    up_BTF = project(x_BTD, self.w_up[...].astype(dtype))  # BTD,DF->BTF
    hidden_BTF = sharding.constrain(jax.nn.silu(gate_BTF) * up_BTF,
                                    ("activation_batch", "activation_length", "activation_mlp"))
    return project(hidden_BTF, self.w_down[...].astype(dtype))  # BTF,FD->BTD


class Block(nnx.Module):
  """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(·))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attention_norm = RMSNorm(cfg, rngs=rngs)
    self.attention = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None,
               cache: LayerCache | None = None) -> tuple[Array, tuple[Array, Array]]:
    attended_BTD, new_kv = self.attention(self.attention_norm(x_BTD), positions_BT, segment_ids_BT, cache)
    h_BTD = x_BTD + attended_BTD
    out_BTD = h_BTD + self.mlp(self.mlp_norm(h_BTD))
    return sharding.constrain(out_BTD, ("activation_batch", "activation_length", "activation_embed")), new_kv


# Position stored in empty cache slots: larger than any query position, so the causal test hides them.
EMPTY_POSITION = 2**30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One layer's view of the KV cache: either the stacked k, v [L, B, K, S, H] and this layer's index in them, or
  (layer None) the layer's own k, v [B, K, S, H]; slot positions [B, S]; the next slot to write."""
  k: Array
  v: Array
  layer: Array | int | None
  positions: Array
  index: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """The decoding cache, an explicit pytree passed in and returned (never module state).

  k, v: rotated keys and values, [L, B, K, S, H] for the stacked model (its layer scan indexes them), or a tuple of
  L buffers [B, K, S, H] (`per_layer`, for ``Llama(stacked_layers=False)``: each layer then reads and updates its own
  buffers in place, with no slice copied per step). S is the slot axis; [K, S, H] is the layout the attention
  products read without a transpose. positions: [B, S] the position of the token in each slot (EMPTY_POSITION where
  empty or padding); index: int32 scalar, the next slot to write.
  """
  k: Array | tuple[Array, ...]
  v: Array | tuple[Array, ...]
  positions: Array
  index: Array

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, length: int, per_layer: bool = False) -> "KVCache":
    shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
    if per_layer:
      k = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
      v = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
    else:
      k = jnp.zeros((cfg.n_layers, *shape), cfg.dtype)
      v = jnp.zeros((cfg.n_layers, *shape), cfg.dtype)
    return cls(k=k, v=v, positions=jnp.full((batch, length), EMPTY_POSITION, jnp.int32),
               index=jnp.zeros((), jnp.int32))


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Llama(nnx.Module):
  """Token embedding → L stacked blocks (run by ``lax.scan``) → final RMSNorm → LM head (tied or not).

  `stacked_layers=False` holds the blocks as a list of L separate modules instead (params from `unstack_layers`):
  the decoding layout, where a step then reads each layer's weights in place rather than slicing them out of the
  stacked arrays (a copy of every weight per step on XLA:CPU).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stacked_layers: bool = True):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), cfg)

    # One Block whose every parameter has a leading "layers" axis, so the forward pass is a single scan.
    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs: nnx.Rngs) -> Block:
      return Block(cfg, rngs=rngs)

    if stacked_layers:
      self.layers = make_layers(rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else _param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), cfg)

  def __call__(self, tokens_BT: Array, positions_BT: Array | None = None, segment_ids_BT: Array | None = None,
               cache: KVCache | None = None):
    """Float32 logits [B, T, V]; with a cache, (logits, updated cache).

    Positions default to 0..T-1. Tokens attend only within their segment id (packed sequences); id 0 marks padding.
    With a cache, the T tokens fill slots index..index+T-1 (padding tokens, segment id 0, are stored as empty) and
    attend to every earlier filled slot by position.
    """
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
    x_BTD = sharding.constrain(x_BTD, ("activation_batch", "activation_length", "activation_embed"))
    if isinstance(self.layers, nnx.List):
      return self._unstacked_forward(x_BTD, positions_BT, segment_ids_BT, cache)
    graphdef, layer_state = nnx.split(self.layers)

    if cache is None:
      def run_layer(h_BTD, one_layer_state):
        block = nnx.merge(graphdef, one_layer_state, copy=True)
        return block(h_BTD, positions_BT, segment_ids_BT)[0], None

      if cfg.remat != "none":
        run_layer = jax.checkpoint(run_layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
      if cfg.scan_layers:
        x_BTD, _ = jax.lax.scan(run_layer, x_BTD, layer_state)
      else:
        for i in range(cfg.n_layers):
          x_BTD, _ = run_layer(x_BTD, jax.tree.map(lambda a, i=i: a[i], layer_state))
      return self._logits(x_BTD)

    if isinstance(cache.k, (tuple, list)):
      raise ValueError("a per-layer KV cache needs Llama(stacked_layers=False); the stacked model scans a stacked "
                       "cache (KVCache.empty(..., per_layer=False))")
    slot_positions = self._slot_positions(positions_BT, segment_ids_BT, cache)

    def run_cached_layer(carry, layer):
      # The whole stacked cache rides in the carry, so each layer writes only its T new slots (scan inputs and
      # outputs would copy a layer's whole cache in and out every step).
      h_BTD, k_all, v_all = carry
      one_layer_state, index = layer
      block = nnx.merge(graphdef, one_layer_state, copy=True)
      layer_cache = LayerCache(k=k_all, v=v_all, layer=index, positions=slot_positions, index=cache.index)
      h_BTD, (k_all, v_all) = block(h_BTD, positions_BT, segment_ids_BT, layer_cache)
      return (h_BTD, k_all, v_all), None

    (x_BTD, k_all, v_all), _ = jax.lax.scan(run_cached_layer, (x_BTD, cache.k, cache.v),
                                            (layer_state, jnp.arange(cfg.n_layers)))
    new_cache = KVCache(k=k_all, v=v_all, positions=slot_positions, index=cache.index + tokens_BT.shape[1])
    return self._logits(x_BTD), new_cache

  def _unstacked_forward(self, x_BTD, positions_BT, segment_ids_BT, cache):
    """The layers as L separate blocks in a Python loop (no remat: this layout is for decoding)."""
    if cache is None:
      for block in self.layers:
        x_BTD = block(x_BTD, positions_BT, segment_ids_BT)[0]
      return self._logits(x_BTD)
    slot_positions = self._slot_positions(positions_BT, segment_ids_BT, cache)
    per_layer = isinstance(cache.k, (tuple, list))
    k_all, v_all = (list(cache.k), list(cache.v)) if per_layer else (cache.k, cache.v)
    for index, block in enumerate(self.layers):
      if per_layer:
        layer_cache = LayerCache(k=k_all[index], v=v_all[index], layer=None, positions=slot_positions,
                                 index=cache.index)
        x_BTD, (k_all[index], v_all[index]) = block(x_BTD, positions_BT, segment_ids_BT, layer_cache)
      else:
        layer_cache = LayerCache(k=k_all, v=v_all, layer=index, positions=slot_positions, index=cache.index)
        x_BTD, (k_all, v_all) = block(x_BTD, positions_BT, segment_ids_BT, layer_cache)
    if per_layer:
      k_all, v_all = tuple(k_all), tuple(v_all)
    new_cache = KVCache(k=k_all, v=v_all, positions=slot_positions, index=cache.index + x_BTD.shape[1])
    return self._logits(x_BTD), new_cache

  @staticmethod
  def _slot_positions(positions_BT, segment_ids_BT, cache: KVCache) -> Array:
    """The cache's slot positions with this call's T tokens written at the cache index (padding stored as empty)."""
    stored_BT = positions_BT if segment_ids_BT is None else jnp.where(segment_ids_BT != 0, positions_BT,
                                                                        EMPTY_POSITION)
    return jax.lax.dynamic_update_slice(cache.positions, stored_BT.astype(jnp.int32), (0, cache.index))

  def _logits(self, x_BTD: Array) -> Array:
    x_BTD = self.final_norm(x_BTD)
    dtype = x_BTD.dtype
    head_DV = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    logits_BTV = project(x_BTD, head_DV.astype(dtype), preferred_element_type=jnp.float32)  # BTD,DV->BTV
    return sharding.constrain(logits_BTV, ("activation_batch", "activation_length", "activation_vocab"))


def unstack_layers(params: dict) -> dict:
  """Pure-dict params of a stacked Llama → those of ``Llama(cfg, stacked_layers=False)`` (one dict per layer)."""
  n_layers = jax.tree.leaves(params["layers"])[0].shape[0]
  return dict(params, layers={i: jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(n_layers)})
