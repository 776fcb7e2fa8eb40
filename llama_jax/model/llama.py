"""LLaMA 2 as flax.nnx modules: RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP, Block, Llama.

Axis legend of the whole package, defined here only: the shape suffix of an array name (``q_BTNH``) and the
upper-case letters of an einsum use these letters, each with this meaning and no other.
  B batch
  T query length: the positions being computed (a sequence, a prompt, a padded prompt bucket, a query chunk, a
    device's slice of the sequence)
  S key/value length: the positions attended to
  N query heads
  K kv heads
  G query heads per kv head (N / K)
  H head dim
  D model dim
  F MLP hidden dim
  V vocabulary
  L layers
  E experts
Every other dimension (LoRA rank, chunks, a mixture of experts' flattened tokens, top-k choices, slots, tiles ...)
has no letter: its array is named without a suffix and its shape spelled out in words where it is made, and an
einsum writes it as a lower-case letter explained in a comment beside it.

Parameters carry logical axis names (see ``run_config.DEFAULT_LOGICAL_AXIS_RULES``); the mesh mapping lives in the run
config, never here. Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` where they are used;
norms, softmax and logits are computed in float32. An int8 model (``cfg.quantize == "int8"``, for decoding) stores
the projections and the embedding as int8 with a float32 ``<weight>_scale`` per output channel, applied to each
product's output by ``project`` (the table of weights and axes is in quantize.py).

The rotary embedding is rope.py's; the params-dict layouts of the stacked and unstacked layers, layer_layout.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import LoraConfig
from llama_jax.model import attention as attention_lib
from llama_jax.model import context as context_lib
from llama_jax.model import layer_layout, quantize, sharding
from llama_jax.model import lora as lora_lib
from llama_jax.model import moe as moe_lib
from llama_jax.model.kv_cache import EMPTY_POSITION, KVCache, LayerCache
from llama_jax.model.rope import RotaryEmbedding

Array = jax.Array


def _param(rngs: nnx.Rngs, shape, logical_axes, cfg: ModelConfig, init=None) -> nnx.Param:
  init = init or jax.nn.initializers.normal(cfg.init_std)
  value = init(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
  # No eager sharding: shardings are applied by the caller (sharding.init_model: abstract init, then jit with
  # out_shardings), so modules can also be built with no mesh at all (tests, conversion).
  return nnx.Param(value, out_sharding=logical_axes, eager_sharding=False)


def _weight(rngs: nnx.Rngs, name: str, shape, logical_axes, cfg: ModelConfig) -> tuple[nnx.Param, nnx.Param | None]:
  """(weight, None) for a float model; (int8 weight, float32 scale of its output channels) when cfg.quantize is
  "int8". An int8 model's own initialisation is a placeholder (zeros, scale 1) giving shapes and shardings: its
  values come from `quantize.quantize_params` of float weights."""
  if cfg.quantize == "none":
    return _param(rngs, shape, logical_axes, cfg), None
  scale_shape, scale_axes = quantize.scale_layout(name, shape, logical_axes)
  q = nnx.Param(jnp.zeros(shape, jnp.int8), out_sharding=logical_axes, eager_sharding=False)
  scale = nnx.Param(jnp.ones(scale_shape, jnp.float32), out_sharding=scale_axes, eager_sharding=False)
  return q, scale


def _add_projections(module: nnx.Module, layouts: dict, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoraConfig | None):
  """Sets each projection `name: (shape, logical axes)` of `layouts` on `module` as `name` (and `name_scale` for an
  int8 model), with its LoRA adapters `name_lora_a` / `name_lora_b` when `lora` targets it."""
  for name, (shape, axes) in layouts.items():
    weight, weight_scale = _weight(rngs, name, shape, axes, cfg)
    setattr(module, name, weight)
    setattr(module, name + "_scale", weight_scale)
    adapter_a, adapter_b = lora_lib.adapter_pair(rngs, name, shape, axes, lora)
    if adapter_a is not None:
      setattr(module, name + lora_lib.A_SUFFIX, adapter_a)
      setattr(module, name + lora_lib.B_SUFFIX, adapter_b)
  module.lora_scale = lora.scale if lora is not None and lora.rank else 0.0


def _value(param: nnx.Param | None) -> Array | None:
  return None if param is None else param[...]


def project(
  x: Array,
  w: Array,
  scale: Array | None = None,
  *,
  preferred_element_type=None,
  lora: tuple[Array, Array, float] | None = None,
) -> Array:
  """x[..., in] · w[in, out...] as one 2-D matrix product in x's dtype, for every projection of the model; with an
  int8 model's `scale` [out...], the int8 weight is widened inside the product and the output scaled per channel.
  With `lora` = (A [in..., rank], B [rank, out...], s) (lora.py), adds s·(x·A)·B: two thin products through the
  rank, so neither the forward nor the gradients ever form an [in, out] matrix for the adapter.

  Same numbers as the einsum it replaces (written next to each call), but XLA's CPU backend runs a 2-D dot and its
  weight gradient far faster than the same contraction written over [B, T] (BENCHMARKS.md, "Figures behind the
  code"). The reshapes are free (contiguous) and keep shardings, since
  the batch stays the major axis. Scaling the output is the same math as scaling the weight's output channels, on
  [B·T, out] values instead of [in, out], and never holds a float copy of the weight. The scale is applied in the
  output's dtype (float32 for the logits, which accumulate in float32).
  """
  lead_shape, out_shape = x.shape[:-1], w.shape[1:]
  w_matrix = w.reshape(w.shape[0], -1).astype(x.dtype)  # [in, out]
  y = jnp.dot(x.reshape(-1, x.shape[-1]), w_matrix, preferred_element_type=preferred_element_type)
  y = y.reshape(*lead_shape, *out_shape)
  y = y if scale is None else y * scale.astype(y.dtype)
  if lora is not None:  # after the int8 scale: the adapter's product is float already
    a, b, lora_scale = lora
    rank = a.shape[-1]
    low_rank = jnp.dot(x.reshape(-1, x.shape[-1]), a.reshape(-1, rank).astype(x.dtype))  # [B·T, rank]
    update = lora_scale * jnp.dot(low_rank, b.reshape(rank, -1).astype(x.dtype))
    y = y + update.reshape(*lead_shape, *out_shape).astype(y.dtype)
  return y


class RMSNorm(nnx.Module):
  """x / rms(x) · scale, with the statistics in float32 (as Meta and HF do) and the result in the input dtype."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.eps = cfg.norm_eps
    self.scale = _param(rngs, (cfg.dim,), ("norm",), cfg, init=jax.nn.initializers.ones)

  def _centre(self, x32: Array) -> Array:
    return x32  # RMSNorm does not subtract the mean

  @jax.named_scope("norm")
  def __call__(self, x: Array) -> Array:
    x32 = self._centre(x.astype(jnp.float32))
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


class LayerNorm(RMSNorm):
  """(x − mean(x)) / std(x) · scale, statistics in float32 as RMSNorm's; scale only, no bias (``model.norm =
  "layernorm"``: the original Transformer's norm, for comparing norms on the LLaMA blocks)."""

  def _centre(self, x32: Array) -> Array:
    return x32 - jnp.mean(x32, axis=-1, keepdims=True)


def make_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm | LayerNorm | None:
  """The norm `cfg.norm` names; None for "none", so such a model holds no norm parameters at all."""
  return {"rmsnorm": RMSNorm, "layernorm": LayerNorm}[cfg.norm](cfg, rngs=rngs) if cfg.norm != "none" else None


class Attention(nnx.Module):
  """Grouped-query self-attention: N query heads share K kv heads (G = N / K); kv heads are never repeated."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
    self.cfg = cfg
    d, n, k, h = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    layouts = {
      "wq": ((d, n, h), ("embed", "heads", "head_dim")),
      "wk": ((d, k, h), ("embed", "kv_heads", "head_dim")),
      "wv": ((d, k, h), ("embed", "kv_heads", "head_dim")),
      "wo": ((n, h, d), ("heads", "head_dim", "embed")),
    }
    _add_projections(self, layouts, cfg, rngs, lora)
    self.rope = RotaryEmbedding(cfg)

  def rotated_qkv(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
    """(q [B, T, N, H], k [B, T, K, H] rotated by position, v [B, T, K, H]): what every attention kernel reads (also
    the inspection forward of analysis/inspection.py, which forms the probabilities itself)."""
    q_BTNH = project(x_BTD, self.wq[...], _value(self.wq_scale), lora=lora_lib.factors(self, "wq"))  # BTD,DNH->BTNH
    k_BTKH = project(x_BTD, self.wk[...], _value(self.wk_scale), lora=lora_lib.factors(self, "wk"))  # BTD,DKH->BTKH
    v_BTKH = project(x_BTD, self.wv[...], _value(self.wv_scale), lora=lora_lib.factors(self, "wv"))  # BTD,DKH->BTKH
    q_BTNH = sharding.constrain(q_BTNH, ("activation_batch", "activation_length", "activation_heads", None))
    k_BTKH = sharding.constrain(k_BTKH, ("activation_batch", "activation_length", "activation_kv_heads", None))
    return self.rope(q_BTNH, positions_BT), self.rope(k_BTKH, positions_BT), v_BTKH

  def output_projection(self, out_BTNH: Array) -> Array:
    """The heads' outputs [B, T, N, H] projected back to the model dim [B, T, D] by wo."""
    b, t, n, h = out_BTNH.shape
    wo_matrix = self.wo[...].reshape(n * h, -1)  # [N·H, D]
    return project(
      out_BTNH.reshape(b, t, n * h), wo_matrix, _value(self.wo_scale), lora=lora_lib.factors(self, "wo")
    )  # BTNH,NHD->BTD

  @jax.named_scope("attention")
  def __call__(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None) -> Array:
    """Output [B, T, D]: each query attends to the earlier tokens of this call with its segment id."""
    q_BTNH, k_BTKH, v_BTKH = self.rotated_qkv(x_BTD, positions_BT)
    if sharding.context_axes()[1] > 1:  # the sequence is split over the mesh's context axes
      out_BTNH = context_lib.context_attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        segment_ids=segment_ids_BT,
        strategy=self.cfg.context_strategy,
        implementation=self.cfg.attention,
      )
    else:
      out_BTNH = attention_lib.attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        q_segment_ids=segment_ids_BT,
        kv_segment_ids=segment_ids_BT,
        implementation=self.cfg.attention,
      )
    return self.output_projection(out_BTNH)

  @jax.named_scope("attention")
  def decode(self, x_BTD: Array, positions_BT: Array, cache: LayerCache) -> tuple[Array, tuple[Array, Array]]:
    """(output [B, T, D], updated k, v): this call's keys and values written at slot `cache.index` of the layer's
    own [B, K, S, H] buffers (or of the stacked [L, B, K, S, H] ones), and the queries attending over every filled
    slot by position."""
    dtype = x_BTD.dtype
    q_BTNH, k_BTKH, v_BTKH = self.rotated_qkv(x_BTD, positions_BT)
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
    out_BTNH = attention_lib.cached_attention(
      q_BTNH, k_BKSH.astype(dtype), v_BKSH.astype(dtype), q_positions=positions_BT, kv_positions=cache.positions
    )
    return self.output_projection(out_BTNH), new_kv


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) · up(x)); the width F follows LLaMA's rule (``ModelConfig.hidden_dim``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
    d, f = cfg.dim, cfg.hidden_dim
    layouts = {
      "w_gate": ((d, f), ("embed", "mlp")),
      "w_up": ((d, f), ("embed", "mlp")),
      "w_down": ((f, d), ("mlp", "embed")),
    }
    _add_projections(self, layouts, cfg, rngs, lora)

  @jax.named_scope("mlp")
  def __call__(self, x_BTD: Array) -> Array:
    gate_BTF = project(x_BTD, self.w_gate[...], _value(self.w_gate_scale), lora=lora_lib.factors(self, "w_gate"))
    up_BTF = project(x_BTD, self.w_up[...], _value(self.w_up_scale), lora=lora_lib.factors(self, "w_up"))
    hidden_BTF = sharding.constrain(
      jax.nn.silu(gate_BTF) * up_BTF, ("activation_batch", "activation_length", "activation_mlp")
    )  # gate, up: BTD,DF->BTF
    return project(
      hidden_BTF, self.w_down[...], _value(self.w_down_scale), lora=lora_lib.factors(self, "w_down")
    )  # BTF,FD->BTD


# Each expert weight's logical axes: stacked SwiGLU projections, experts first.
EXPERT_AXES = {
  "w_gate": ("expert", "embed", "mlp"),
  "w_up": ("expert", "embed", "mlp"),
  "w_down": ("expert", "mlp", "embed"),
}


class MoE(nnx.Module):
  """A mixture of SwiGLU experts (``cfg.moe``): a linear router picks top_k of num_experts per token and the token's
  output is their outputs weighted by the routing (moe.py runs them). Expert weights are stacked [E, ...] with the
  logical axis "expert" first, so the mesh mapping decides where experts live."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f, e = cfg.dim, cfg.hidden_dim, cfg.moe.num_experts
    self.router = _param(rngs, (d, e), ("embed", None), cfg)
    for name, axes in EXPERT_AXES.items():
      shape = {"expert": e, "embed": d, "mlp": f}
      setattr(self, name, _param(rngs, tuple(shape[axis] for axis in axes), axes, cfg))

  @jax.named_scope("moe")
  def __call__(self, x_BTD: Array, mask_BT: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """(output [B, T, D], this layer's router sums (moe.router_sums) over the tokens where `mask_BT` is true)."""
    cfg = self.cfg.moe
    b, t, d = x_BTD.shape
    x = x_BTD.reshape(b * t, d)  # [tokens, D]: the call's B·T tokens, as moe.py takes them
    router_logits = project(x, self.router[...], preferred_element_type=jnp.float32)  # mD,DE->mE, m: tokens
    choice_weights, choice_experts, router_probs = moe_lib.route(router_logits, cfg)
    experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
    sums = moe_lib.router_sums(
      router_logits, router_probs, choice_experts, None if mask_BT is None else mask_BT.reshape(-1)
    )
    grouped = cfg.grouped
    if grouped == "auto":
      grouped = "tiles" if sharding.target_platform() == "cpu" else "ragged_dot"
    if cfg.compute == "dense" and moe_lib.expert_devices() > 1:
      raise sharding.ShardingError("model.moe.compute='dense' (the reference) does not run with mesh.expert > 1")
    if cfg.compute != "dense" and sharding.active_rules() is not None:
      # Per device (shard_map): each device routes its own tokens, to its own experts or, with mesh.expert > 1,
      # to the experts' devices by all-to-all. Left to the compiler, sorting the batch-sharded tokens gathered every
      # token everywhere (BENCHMARKS.md, "Figures behind the code").
      y, dropped = moe_lib.sharded_experts(
        x,
        choice_weights,
        choice_experts,
        experts,
        [EXPERT_AXES[name] for name in ("w_gate", "w_up", "w_down")],
        grouped=grouped,
        capacity_factor=cfg.capacity_factor if cfg.compute == "capacity" else None,
      )
      if cfg.compute == "capacity":
        sums["dropped"] = dropped
    elif cfg.compute == "dense":
      y = moe_lib.dense(x, choice_weights, choice_experts, *experts)
    elif cfg.compute == "capacity":
      y, sums["dropped"] = moe_lib.capacity(x, choice_weights, choice_experts, *experts, cfg.capacity_factor)
    else:
      y = moe_lib.dropless(x, choice_weights, choice_experts, *experts, grouped)
    return y.reshape(b, t, d), sums


class Block(nnx.Module):
  """Residual block. Pre-norm (LLaMA, `cfg.norm_position == "pre"`): h = x + attention(norm(x)), out = h + mlp(norm(h)).
  Post-norm (the original Transformer): h = norm(x + attention(x)), out = norm(h + mlp(h)). `attention_norm` and
  `mlp_norm` keep their names in both (the norm around each sub-layer); with `cfg.norm == "none"` there are none.
  With `moe` (default: whether `cfg.moe` is on), `mlp` is a mixture of experts, and the block also returns its router
  sums (else an empty dict)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None, moe: bool | None = None):
    self.pre_norm = cfg.norm_position == "pre"
    self.attention_norm = make_norm(cfg, rngs)
    self.attention = Attention(cfg, rngs=rngs, lora=lora)
    self.mlp_norm = make_norm(cfg, rngs)
    moe = cfg.moe.enabled if moe is None else moe
    self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs, lora=lora)

  def __call__(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None) -> tuple[Array, dict[str, Array]]:
    """(output [B, T, D], router sums): the router statistics count the tokens that are not padding."""
    attended_BTD = self.attention(self.norm_in(self.attention_norm, x_BTD), positions_BT, segment_ids_BT)
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    return self.mlp_residual(self.norm_out(self.attention_norm, x_BTD + attended_BTD), mask_BT)

  def decode(self, x_BTD: Array, positions_BT: Array, cache: LayerCache) -> tuple[Array, tuple[Array, Array]]:
    attended_BTD, new_kv = self.attention.decode(self.norm_in(self.attention_norm, x_BTD), positions_BT, cache)
    out_BTD, _ = self.mlp_residual(self.norm_out(self.attention_norm, x_BTD + attended_BTD))
    return out_BTD, new_kv

  def norm_in(self, norm: RMSNorm | LayerNorm | None, x_BTD: Array) -> Array:
    """What a sub-layer reads: norm(x) in a pre-norm block, x itself in a post-norm one (or with no norm)."""
    return norm(x_BTD) if norm is not None and self.pre_norm else x_BTD

  def norm_out(self, norm: RMSNorm | LayerNorm | None, h_BTD: Array) -> Array:
    """The residual sum passed on: norm(h) in a post-norm block, h itself in a pre-norm one."""
    return norm(h_BTD) if norm is not None and not self.pre_norm else h_BTD

  def mlp_residual(self, h_BTD: Array, mask_BT: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """The block's second half: the MLP sub-layer and its residual sum (normed as the block's norm position says),
    with the router sums of a mixture of experts over the tokens of `mask_BT` (an empty dict for a dense MLP)."""
    mlp_in_BTD = self.norm_in(self.mlp_norm, h_BTD)
    if isinstance(self.mlp, MoE):
      mlp_out_BTD, router = self.mlp(mlp_in_BTD, mask_BT)
    else:
      mlp_out_BTD, router = self.mlp(mlp_in_BTD), {}
    out_BTD = self.norm_out(self.mlp_norm, h_BTD + mlp_out_BTD)
    return sharding.constrain(out_BTD, ("activation_batch", "activation_length", "activation_embed")), router


class BlockGroup(nnx.Module):
  """`cfg.moe.every` consecutive blocks, the last with a mixture of experts and the others dense: what the stacked
  model scans when only every k-th block is MoE (the steps of a scan must be alike). Its router sums are its MoE
  block's."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
    every = cfg.moe.every
    self.blocks = nnx.List([Block(cfg, rngs=rngs, lora=lora, moe=j == every - 1) for j in range(every)])

  def __call__(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None) -> tuple[Array, dict[str, Array]]:
    for block in self.blocks:
      x_BTD, router = block(x_BTD, positions_BT, segment_ids_BT)
    return x_BTD, router

  def decode(self, x_BTD: Array, positions_BT: Array, cache: LayerCache) -> tuple[Array, tuple[Array, Array]]:
    """`cache.layer` is the group's first layer in the stacked cache; block j reads and writes layer + j."""
    k_all, v_all = cache.k, cache.v
    for j, block in enumerate(self.blocks):
      layer_cache = dataclasses.replace(cache, k=k_all, v=v_all, layer=cache.layer + j)
      x_BTD, (k_all, v_all) = block.decode(x_BTD, positions_BT, layer_cache)
    return x_BTD, (k_all, v_all)


def stacked_unit(cfg: ModelConfig) -> tuple[type[Block] | type[BlockGroup], int]:
  """(what the stacked model's scan steps over, how many): L blocks, or L/every groups of `every` blocks when only
  every `moe.every`-th block is a mixture of experts (layer_layout.blocks_per_unit)."""
  per_unit = layer_layout.blocks_per_unit(cfg)
  return (Block if per_unit == 1 else BlockGroup), cfg.n_layers // per_unit


def _stack_rows(per_layer: list[dict[str, Array]]) -> dict[str, Array]:
  """Router sums of the MoE blocks, one row each ([L_moe, ...]); an empty dict for a dense model."""
  rows = [router for router in per_layer if router]
  return jax.tree.map(lambda *r: jnp.stack(r), *rows) if rows else {}


_REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Llama(nnx.Module):
  """LLaMA as one flax.nnx module: token embedding, L blocks, final norm and LM head, tied or not.

  The final norm is the one `cfg.norm` names, RMSNorm for LLaMA, and only pre-norm models have it: post-norm blocks
  hand on a normalised stream already. Calling the model, `model(tokens, positions, segment_ids) -> logits`, is the
  full forward of training and evaluation; `decode(tokens, positions, cache) -> (logits, cache)` runs new tokens
  against a KV cache, for a prefill and for each step of decoding.

  Two layouts of the same parameters. Stacked, the default and the training layout: one Block whose every parameter
  has a leading layers axis, run by one ``lax.scan``, so the compile time does not depend on the depth; with
  `moe.every` > 1, one BlockGroup of `every` blocks with the leading axis L/every, block i being group i // every's
  block i % every. `stacked_layers=False`, the decoding layout: a list of L separate blocks, with params from
  `unstack_layers`. A step then reads each layer's weights and writes its cache buffers in place, where slicing them
  out of stacked arrays copied every weight per step on XLA:CPU (BENCHMARKS.md, "Figures behind the code"). Each
  layout decodes with its own cache: per-layer buffers for the decoding layout, which the ``Sampler`` runs, and one
  stacked [L, B, K, S, H] cache in the scan carry for the stacked layout, for tests and models too deep to unroll.

  With `lora`, a ``LoraConfig`` of rank > 0, the targeted projections also hold low-rank adapters (lora.py) for LoRA
  training; everything that only runs a model loads the adapters merged into the weights instead.

  Args:
    cfg: the model's hyper-parameters, dtypes and kernels.
    rngs: the random streams the parameters are initialised from.
    stacked_layers: the stacked layout (True) or one block per layer (False).
    lora: adapters to add to the projections it targets, or None for none.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stacked_layers: bool = True, lora: LoraConfig | None = None):
    self.cfg = cfg
    self.embed, self.embed_scale = _weight(rngs, "embed", (cfg.vocab_size, cfg.dim), ("vocab", "embed"), cfg)

    unit, n_units = stacked_unit(cfg)

    # One Block (or BlockGroup) whose every parameter has a leading "layers" axis, so the forward pass is one scan.
    @nnx.split_rngs(splits=n_units)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs: nnx.Rngs) -> Block | BlockGroup:
      return unit(cfg, rngs=rngs, lora=lora)

    if stacked_layers:
      self.layers = make_layers(rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs, lora=lora, moe=cfg.is_moe_layer(i)) for i in range(cfg.n_layers)])
    # Post-norm blocks hand on a normalised stream already: a final norm would only apply a second scale to it.
    self.final_norm = make_norm(cfg, rngs) if cfg.norm_position == "pre" else None
    self.lm_head, self.lm_head_scale = (
      (None, None)
      if cfg.tie_embeddings
      else _weight(rngs, "lm_head", (cfg.dim, cfg.vocab_size), ("embed", "vocab"), cfg)
    )

  @property
  def stacked(self) -> bool:
    """Whether the layers are in the stacked layout, the one `stacked_layers=True` builds."""
    return not isinstance(self.layers, nnx.List)

  def __call__(self, tokens_BT: Array, positions_BT: Array | None = None, segment_ids_BT: Array | None = None) -> Array:
    """The full forward: float32 logits [B, T, V] of every position.

    Each token attends only to the earlier tokens with its own segment id, so that packed sequences stay apart.

    Args:
      tokens_BT: token ids [B, T].
      positions_BT: the tokens' positions [B, T], or None for 0..T-1 in every row.
      segment_ids_BT: the tokens' segment ids [B, T], id 0 marking padding, or None for one sequence per row.

    Returns:
      Float32 logits [B, T, V].
    """
    return self.logits(self.hidden(tokens_BT, positions_BT, segment_ids_BT))

  def hidden(self, tokens_BT: Array, positions_BT: Array | None = None, segment_ids_BT: Array | None = None) -> Array:
    """The residual stream after the last block [B, T, D], before the final norm and the head.

    What a loss computed in chunks of the sequence projects a chunk at a time, through `logits`.

    Args:
      tokens_BT: token ids [B, T].
      positions_BT: the tokens' positions [B, T], or None for 0..T-1 in every row.
      segment_ids_BT: the tokens' segment ids [B, T], id 0 marking padding, or None for one sequence per row.

    Returns:
      The residual stream [B, T, D].
    """
    return self.forward(tokens_BT, positions_BT, segment_ids_BT)[0]

  def forward(
    self, tokens_BT: Array, positions_BT: Array | None = None, segment_ids_BT: Array | None = None
  ) -> tuple[Array, dict[str, Array]]:
    """The residual stream of `hidden` and the router sums of a mixture of experts.

    What the training objective reads: the router sums give its balance losses.

    Args:
      tokens_BT: token ids [B, T].
      positions_BT: the tokens' positions [B, T], or None for 0..T-1 in every row.
      segment_ids_BT: the tokens' segment ids [B, T], id 0 marking padding, or None for one sequence per row.

    Returns:
      A tuple: the residual stream [B, T, D], and the router sums [L_moe, ...] of `moe.router_sums`, one row per MoE
        block, or an empty dict for a dense model.
    """
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    # Zigzag context parallelism runs the blocks on the zigzag layout (context.py): the ids and positions go there
    # before the embedding, and the residual stream comes back after the last block.
    zigzag = self.cfg.context_strategy == "zigzag" and sharding.context_axes()[1] > 1
    if zigzag:
      tokens_BT, positions_BT, segment_ids_BT = (
        context_lib.to_zigzag(x, ("activation_batch", "activation_length"))
        for x in (tokens_BT, positions_BT, segment_ids_BT)
      )
    x_BTD, router = self._blocks(self.embed_tokens(tokens_BT), positions_BT, segment_ids_BT)
    if zigzag:
      x_BTD = context_lib.from_zigzag(x_BTD, ("activation_batch", "activation_length", "activation_embed"))
    return x_BTD, router

  def _blocks(self, x_BTD: Array, positions_BT: Array, segment_ids_BT: Array | None) -> tuple[Array, dict[str, Array]]:
    """The residual stream through every block, and the router sums (`forward`)."""
    cfg = self.cfg
    if not self.stacked:
      per_layer = []
      for block in self.layers:
        x_BTD, router = block(x_BTD, positions_BT, segment_ids_BT)
        per_layer.append(router)
      return x_BTD, _stack_rows(per_layer)
    graphdef, layer_state = nnx.split(self.layers)

    def run_layer(h_BTD, one_layer_state):
      return nnx.merge(graphdef, one_layer_state, copy=True)(h_BTD, positions_BT, segment_ids_BT)

    if cfg.remat != "none":
      run_layer = jax.checkpoint(run_layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      return jax.lax.scan(run_layer, x_BTD, layer_state)
    per_layer = []
    for i in range(stacked_unit(cfg)[1]):
      x_BTD, router = run_layer(x_BTD, jax.tree.map(lambda a, i=i: a[i], layer_state))
      per_layer.append(router)
    return x_BTD, _stack_rows(per_layer)

  def decode(
    self,
    tokens_BT: Array,
    positions_BT: Array | None,
    cache: KVCache,
    segment_ids_BT: Array | None = None,
    logits_at_B: Array | None = None,
  ) -> tuple[Array, KVCache]:
    """Runs T new tokens of each row against a KV cache: a prefill, or one step of decoding.

    The T tokens fill slots index..index+T-1 of the cache and attend to every earlier filled slot by position;
    padding, segment id 0, is stored as empty. The cache's layout must be the model's (`KVCache.empty`'s
    `per_layer` for ``stacked_layers=False``).

    Args:
      tokens_BT: token ids [B, T].
      positions_BT: the tokens' positions [B, T], or None for index..index+T-1.
      cache: the cache to write the new keys and values into and attend over.
      segment_ids_BT: the tokens' segment ids [B, T], id 0 marking padding, or None when there is none.
      logits_at_B: [B] the index along T of the one token of each row whose logits are wanted, or None for every
        token's. A prefill needs only the last prompt token's, and the head over every prompt position was a large
        part of a stories15M prefill (BENCHMARKS.md).

    Returns:
      A tuple: float32 logits [B, T, V], or [B, 1, V] with `logits_at_B`, and the updated cache, its index moved on
        by T.

    Raises:
      ValueError: the cache's layout is not the model's: a per-layer cache for the stacked model, or a stacked one
        for ``stacked_layers=False``.
    """
    if isinstance(cache.k, (tuple, list)) == self.stacked:
      raise ValueError(
        "a per-layer KV cache needs Llama(stacked_layers=False); the stacked model scans a stacked "
        "cache (KVCache.empty(..., per_layer=False))"
        if self.stacked
        else "Llama(stacked_layers=False) decodes with a per-layer KV cache (KVCache.empty(..., per_layer=True))"
      )
    if positions_BT is None:
      positions_BT = cache.index + jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    x_BTD = self.embed_tokens(tokens_BT)
    stored_BT = positions_BT if segment_ids_BT is None else jnp.where(segment_ids_BT != 0, positions_BT, EMPTY_POSITION)
    slot_positions = jax.lax.dynamic_update_slice(cache.positions, stored_BT.astype(jnp.int32), (0, cache.index))
    if not self.stacked:
      k_all, v_all = list(cache.k), list(cache.v)
      for index, block in enumerate(self.layers):
        layer_cache = LayerCache(
          k=k_all[index], v=v_all[index], layer=None, positions=slot_positions, index=cache.index
        )
        x_BTD, (k_all[index], v_all[index]) = block.decode(x_BTD, positions_BT, layer_cache)
      k_all, v_all = tuple(k_all), tuple(v_all)
    else:
      graphdef, layer_state = nnx.split(self.layers)

      def run_cached_layer(carry, layer):
        # The whole stacked cache rides in the carry, so each layer writes only its T new slots (scan inputs and
        # outputs would copy a layer's whole cache in and out every step).
        h_BTD, k_all, v_all = carry
        one_layer_state, index = layer
        layer_cache = LayerCache(k=k_all, v=v_all, layer=index, positions=slot_positions, index=cache.index)
        h_BTD, (k_all, v_all) = nnx.merge(graphdef, one_layer_state, copy=True).decode(h_BTD, positions_BT, layer_cache)
        return (h_BTD, k_all, v_all), None

      per_unit = layer_layout.blocks_per_unit(self.cfg)
      first_layers = jnp.arange(self.cfg.n_layers // per_unit) * per_unit
      (x_BTD, k_all, v_all), _ = jax.lax.scan(run_cached_layer, (x_BTD, cache.k, cache.v), (layer_state, first_layers))
    new_cache = KVCache(k=k_all, v=v_all, positions=slot_positions, index=cache.index + tokens_BT.shape[1])
    if logits_at_B is not None:
      x_BTD = jnp.take_along_axis(x_BTD, logits_at_B[:, None, None], axis=1)
    return self.logits(x_BTD), new_cache

  def embed_tokens(self, tokens_BT: Array) -> Array:
    """The embedding of token ids: the residual stream the first block reads, in the compute dtype.

    An int8 table is widened only in the rows gathered, each by its own scale.

    Args:
      tokens_BT: token ids [B, T].

    Returns:
      The residual stream [B, T, D].
    """
    dtype = jnp.dtype(self.cfg.dtype)
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
    if self.embed_scale is not None:
      # Only the gathered rows are widened: the per-row scale is the same one the tied head applies per vocab entry.
      x_BTD = x_BTD * jnp.take(self.embed_scale[...], tokens_BT, axis=0)[..., None].astype(dtype)
    return sharding.constrain(x_BTD, ("activation_batch", "activation_length", "activation_embed"))

  def head(self) -> tuple[Array, Array | None]:
    """The LM head's weight and its int8 scale.

    Returns:
      A tuple: the weight [D, V], the embedding's transpose when the head is tied, and its int8 scale [V], or None
        unless the model is int8.
    """
    if self.lm_head is None:
      return self.embed[...].T, _value(self.embed_scale)
    return self.lm_head[...], _value(self.lm_head_scale)

  def logits(self, x_BTD: Array, head: tuple[Array, Array | None] | None = None) -> Array:
    """Float32 logits from the residual stream after the last block: the final norm, then the LM head.

    Args:
      x_BTD: the residual stream [B, T, D], as `hidden` returns it.
      head: the head's weight and scale as `head` returns them, or None to read them here. The chunked loss gives
        them, gathered once for all its chunks.

    Returns:
      Float32 logits [B, T, V].
    """
    x_BTD = x_BTD if self.final_norm is None else self.final_norm(x_BTD)
    head_DV, head_scale_V = self.head() if head is None else head
    logits_BTV = project(x_BTD, head_DV, head_scale_V, preferred_element_type=jnp.float32)  # BTD,DV->BTV
    return sharding.constrain(logits_BTV, ("activation_batch", "activation_length", "activation_vocab"))
