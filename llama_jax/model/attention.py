"""Attention kernels behind one function: XLA everywhere, cudnn flash attention on GPU, splash attention on TPU.

``attention()`` picks the kernel from the backend and the shapes; the accelerator kernels are used only where they
apply, so every configuration also runs on CPU through the XLA paths: "chunked" (causal attention by query chunks,
each against only the keys up to its end, so the upper triangle of the scores is never computed; "auto" uses it
whenever no accelerator kernel applies and the length splits into chunks) and "xla" (the whole [T, S] scores at
once: short or ragged sequences, and decoding). Axis letters: llama.py's legend.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.core.model_config import ATTENTION_IMPLS
from llama_jax.model import sharding

Array = jax.Array
# Masked scores: a large finite value rather than -inf, so a fully masked row (padding) gives a uniform row, never NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SPLASH_BLOCK = 128  # splash tiles the sequence in blocks of this many tokens ...
# ... or of this many where the sequence (each device's slice of the queries, and the keys) divides into them, as
# MaxText's defaults do: the kernel keeps its mask tables, a few entries per pair of blocks, in the chip's SMEM,
# which 128-token blocks of a long sequence overflow ("would exceed memory" in smem, TPU compiler; BENCHMARKS.md,
# "Figures behind the code").
LONG_SPLASH_BLOCK = 512
MIN_CHUNK = 64  # "chunked": query rows per chunk (the fastest on XLA:CPU at T = 256 and 512) ...
MAX_CHUNKS = 16  # ... or more, to keep the unrolled chunk loop at most this long
LONG_SEQUENCE = 2048  # "chunked" from this length on rematerialises each chunk: memory ∝ T·chunk, not T²/2

_log = logging.getLogger(__name__)


def choose_implementation(
  requested: str,
  backend: str,
  *,
  q_len: int,
  kv_len: int,
  head_dim: int,
  dtype,
  has_segment_ids: bool,
  has_positions: bool,
) -> str:
  """The kernel that runs: the requested (or, for "auto", the backend's) accelerator kernel when it applies to these
  shapes, otherwise "xla". Explicit positions (a KV cache) always need the XLA path's positional mask."""
  if requested not in ATTENTION_IMPLS:
    raise ValueError(f"attention implementation must be one of {', '.join(ATTENTION_IMPLS)}; got {requested!r}")
  if requested == "xla" or has_positions:
    return "xla"
  chunkable = q_len == kv_len and chunk_size(q_len) is not None
  fallback = "chunked" if chunkable else "xla"
  wanted = requested if requested != "auto" else {"gpu": "cudnn", "tpu": "splash"}.get(backend, fallback)
  if wanted == "chunked":
    ok = chunkable
  elif wanted == "cudnn":
    # cuDNN's fused kernel: GPU, half precision, head_dim a multiple of 8 up to 128; packed segments go to XLA.
    ok = (
      backend == "gpu"
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0
      and head_dim <= 128
      and not has_segment_ids
    )
  elif wanted == "splash":
    ok = backend == "tpu" and q_len == kv_len and q_len % SPLASH_BLOCK == 0 and head_dim % 64 == 0
  else:
    ok = False
  if not ok and requested != "auto":
    _log.warning(
      "attention=%r does not apply on backend %r with these shapes; using the %s kernel", requested, backend, fallback
    )
  return wanted if ok else fallback


def attention(
  q_BTNH: Array,
  k_BSKH: Array,
  v_BSKH: Array,
  *,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  q_positions: Array | None = None,
  kv_positions: Array | None = None,
  implementation: str = "auto",
) -> Array:
  """Causal grouped-query attention; returns [B, T, N, H] in the dtype of q.

  Without positions, T == S and causality is by index (self-attention over one sequence, packed or not). With
  positions (decoding against a KV cache), key s is visible to query t when kv_positions[s] <= q_positions[t].
  Segment ids restrict attention to equal ids (packed sequences; id 0 is padding). A sequence split over the
  mesh's context axes takes context.py's kernels instead.
  """
  impl = choose_implementation(
    implementation,
    sharding.target_platform(),
    q_len=q_BTNH.shape[1],
    kv_len=k_BSKH.shape[1],
    head_dim=q_BTNH.shape[-1],
    dtype=q_BTNH.dtype,
    has_segment_ids=q_segment_ids is not None,
    has_positions=q_positions is not None,
  )
  if impl == "cudnn":
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="cudnn")
  if impl == "splash":
    return splash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids=q_segment_ids)
  if impl == "chunked":
    return chunked_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids=q_segment_ids)
  return xla_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )


@jax.custom_vjp
def softmax(x: Array) -> Array:
  """Softmax over the last axis whose backward pass keeps only its output.

  jax.nn.softmax's default derivative (jax 0.10, `jax_softmax_custom_jvp` off) keeps the input and the exponentials
  too: two extra [B, K, G, T, S] float32 arrays per layer, which made attention's forward + backward slower on CPU
  (BENCHMARKS.md, "Figures behind the code").
  """
  return jax.nn.softmax(x, axis=-1)


def _softmax_forward(x):
  probs = jax.nn.softmax(x, axis=-1)
  return probs, probs


def _softmax_backward(probs, grad):
  return (probs * (grad - jnp.sum(grad * probs, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_forward, _softmax_backward)


def xla_attention(
  q_BTNH: Array,
  k_BSKH: Array,
  v_BSKH: Array,
  *,
  q_segment_ids=None,
  kv_segment_ids=None,
  q_positions=None,
  kv_positions=None,
) -> Array:
  """Plain einsum attention. Query heads are grouped [K, G] so each kv head serves its G query heads without a copy."""
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  kv_len, n_kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(batch, q_len, n_kv_heads, n_heads // n_kv_heads, head_dim)
  # Scores and softmax in float32 whatever the compute dtype: bf16 logits lose the small differences softmax needs.
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  scores_BKGTS = scores_BKGTS * (1.0 / np.sqrt(head_dim))

  if q_positions is None:
    visible_BTS = jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))[None]
  else:
    visible_BTS = kv_positions[:, None, :] <= q_positions[:, :, None]
  if q_segment_ids is not None:
    visible_BTS = visible_BTS & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, MASK_VALUE)
  probs_BKGTS = softmax(scores_BKGTS).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(batch, q_len, n_heads, head_dim)


def cached_attention(q_BTNH: Array, k_BKSH: Array, v_BKSH: Array, *, q_positions: Array, kv_positions: Array) -> Array:
  """Attention of a few new tokens over a KV cache stored [B, K, S, H] (decoding): key s is visible to query t when
  kv_positions[s] <= q_positions[t]. Written as two batched matrix products with the cache as the right-hand side
  in its stored layout, so nothing is transposed or copied per step."""
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  n_kv_heads = k_BKSH.shape[1]
  q_rows = (
    q_BTNH.reshape(batch, q_len, n_kv_heads, -1, head_dim)
    .transpose(0, 2, 3, 1, 4)
    .reshape(batch, n_kv_heads, -1, head_dim)
  )  # [B, K, G·T, H]: each kv head's G·T query rows, in (g, t) order
  scores = jax.lax.dot_general(q_rows, k_BKSH, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
  scores = scores * (1.0 / np.sqrt(head_dim))  # [B, K, G·T, S]
  groups = n_heads // n_kv_heads
  visible = jnp.tile(kv_positions[:, None, :] <= q_positions[:, :, None], (1, groups, 1))  # [B, G·T, S]
  scores = jnp.where(visible[:, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BKSH.dtype)
  out_rows = jax.lax.dot_general(probs, v_BKSH, (((3,), (2,)), ((0, 1), (0, 1))))  # [B, K, G·T, H]
  return out_rows.reshape(batch, n_kv_heads, groups, q_len, head_dim).transpose(0, 3, 1, 2, 4).reshape(q_BTNH.shape)


def chunk_size(q_len: int) -> int | None:
  """Query rows per chunk of "chunked" attention for a sequence of q_len, or None when it does not split into at
  least two equal chunks."""
  chunk = MIN_CHUNK
  while q_len // chunk > MAX_CHUNKS:
    chunk *= 2
  return chunk if q_len % chunk == 0 and q_len >= 2 * chunk else None


def chunked_attention(
  q_BTNH: Array,
  k_BSKH: Array,
  v_BSKH: Array,
  *,
  segment_ids: Array | None = None,
  chunk: int | None = None,
  remat: bool | None = None,
) -> Array:
  """Causal self-attention (T == S) by query chunks. Exact (whole softmax rows), so it equals `xla_attention`.

  Without `remat` (below LONG_SEQUENCE tokens by default), an unrolled loop in which chunk c attends to keys
  [0, (c+1)·chunk) only: the upper triangle of the scores is never computed, and each chunk's scores stay small
  (forward + backward faster than `xla_attention` on XLA:CPU (BENCHMARKS.md, "Figures behind the code")).
  With `remat`, a `lax.map` over the chunks, each against every key (masked) and recomputed in the backward pass:
  one chunk's [B, N, chunk, S] scores are alive at a time, so memory grows with T·chunk, as the flash kernels' does.
  """
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  chunk = chunk or chunk_size(q_len)
  remat = q_len >= LONG_SEQUENCE if remat is None else remat

  def one_chunk(q_BTNH, k_BSKH, v_BSKH, q_segments_BT, kv_segments_BS, start):
    q_positions = jnp.broadcast_to(start + jnp.arange(q_BTNH.shape[1], dtype=jnp.int32), q_BTNH.shape[:2])
    kv_positions = jnp.broadcast_to(jnp.arange(k_BSKH.shape[1], dtype=jnp.int32), k_BSKH.shape[:2])
    return xla_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      q_segment_ids=q_segments_BT,
      kv_segment_ids=kv_segments_BS,
      q_positions=q_positions,
      kv_positions=kv_positions,
    )

  if remat:
    attend = lambda q_BTNH, segments_BT, start: one_chunk(q_BTNH, k_BSKH, v_BSKH, segments_BT, segment_ids, start)  # noqa: E731
    return map_query_chunks(attend, q_BTNH, segment_ids, chunk)
  outputs = []
  for start in range(0, q_len, chunk):
    end = start + chunk
    segments = (None, None) if segment_ids is None else (segment_ids[:, start:end], segment_ids[:, :end])
    outputs.append(one_chunk(q_BTNH[:, start:end], k_BSKH[:, :end], v_BSKH[:, :end], *segments, start))
  return jnp.concatenate(outputs, axis=1)


def map_query_chunks(attend, q_BTNH: Array, segments_BT: Array | None, chunk: int, first=0) -> Array:
  """`attend(q rows [B, chunk, N, H], their segment ids, index of their first row)` over the queries `chunk` rows
  at a time, in a ``lax.map`` whose steps are rematerialised: one chunk's scores are alive, forward or backward.
  `first` is the index of q's first row in the whole sequence."""
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  n_chunks = q_len // chunk
  q_chunks = q_BTNH.reshape(batch, n_chunks, chunk, n_heads, head_dim).swapaxes(0, 1)  # [chunks, B, chunk, N, H]
  segment_chunks = None if segments_BT is None else segments_BT.reshape(batch, n_chunks, chunk).swapaxes(0, 1)
  step = jax.checkpoint(lambda xs: attend(xs[1], xs[2], first + xs[0] * chunk))
  out_chunks = jax.lax.map(step, (jnp.arange(n_chunks, dtype=jnp.int32), q_chunks, segment_chunks))
  return out_chunks.swapaxes(0, 1).reshape(q_BTNH.shape)


def splash_attention(
  q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, *, segment_ids: Array | None = None, interpret: bool = False
) -> Array:
  """TPU splash (block-sparse flash) attention, causal, with optional segment ids.

  Run per device under ``shard_map`` when a mesh is active: batch and heads are split across devices by the same
  logical rules as the activations (`splash_per_device`). ``interpret=True`` runs it on CPU (tests).
  """
  q_len, n_heads, n_kv_heads = q_BTNH.shape[1], q_BTNH.shape[2], k_BSKH.shape[2]
  kernel = splash_kernel(n_heads // n_kv_heads, q_len, q_len, interpret=interpret)
  local = lambda q, k, v, s: splash_per_device(kernel, q, k, v, s, s)  # noqa: E731
  specs = sharding.active_specs(
    {
      "q": ("activation_batch", None, "activation_heads", None),
      "kv": ("activation_batch", None, "activation_kv_heads", None),
      "seg": ("activation_batch", None),
    }
  )
  if specs is None:
    return local(q_BTNH, k_BSKH, v_BSKH, segment_ids)
  seg_spec = None if segment_ids is None else specs["seg"]
  run = jax.shard_map(
    local, in_specs=(specs["q"], specs["kv"], specs["kv"], seg_spec), out_specs=specs["q"], check_vma=False
  )
  return run(q_BTNH, k_BSKH, v_BSKH, segment_ids)


def splash_kernel(
  groups: int,
  q_len: int,
  kv_len: int,
  *,
  q_seq_shards: int = 1,
  causal: bool = True,
  save_residuals: bool = False,
  interpret: bool = False,
):
  """The splash kernel of attention of `groups` query heads to one kv head, [q_len] queries against [kv_len] keys,
  causal or (`causal=False`) every query to every key (segment ids still apply). With `q_seq_shards` > 1 its mask
  tables are split by query rows, so that under ``shard_map`` (the kernel passed in with
  `kernel.manual_sharding_spec`) each of that many devices attends its own slice of the queries to all the keys by
  global index (context parallelism's all-gather strategy). `save_residuals` makes it return each row's log-sum-exp
  beside the output, with no gradient (`splash_with_lse`; the ring's blocks)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  shape = (q_len, kv_len)
  mask = splash.MultiHeadMask([splash.CausalMask(shape) if causal else splash.FullMask(shape) for _ in range(groups)])
  long = (q_len // q_seq_shards) % LONG_SPLASH_BLOCK == 0 and kv_len % LONG_SPLASH_BLOCK == 0
  block = LONG_SPLASH_BLOCK if long else SPLASH_BLOCK
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  return splash.make_splash_mqa(
    mask,
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=q_seq_shards,
    save_residuals=save_residuals,
    interpret=interpret,
  )


def splash_with_lse(
  kernel, q_BKGTH: Array, k_BKSH: Array, v_BKSH: Array, q_segments_BT: Array, kv_segments_BS: Array
) -> tuple[Array, Array]:
  """The output [B, K, G, T, H] and float32 log-sum-exp [B, K, G, T] of `kernel` (made with save_residuals) on
  scaled queries in the kernel's layout; not differentiable (`splash_block_gradients` is its backward pass)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  def one(q_segments_T, kv_segments_S, q_GTH, k_SH, v_SH):
    out_GTH, (lse_GT,) = kernel(q_GTH, k_SH, v_SH, segment_ids=splash.SegmentIds(q=q_segments_T, kv=kv_segments_S))
    return out_GTH, lse_GT.astype(jnp.float32)

  return _per_sequence_and_kv_head(one, (q_segments_BT, kv_segments_BS), q_BKGTH, k_BKSH, v_BKSH)


def splash_block_gradients(
  kernel,
  q_BKGTH: Array,
  k_BKSH: Array,
  v_BKSH: Array,
  q_segments_BT: Array,
  kv_segments_BS: Array,
  out_BKGTH: Array,
  lse_BKGT: Array,
  dout_BKGTH: Array,
) -> tuple[Array, Array, Array]:
  """The gradients (dq, dk, dv) of one block of keys' share in attention whose output and log-sum-exp per query row
  are `out` and `lse` over all blocks: splash's own backward kernels, given those residuals instead of the block's.
  With the whole row's log-sum-exp each block's probabilities are the true ones, and with the whole row's output
  the softmax term rowsum(dout · out) is too, so the blocks' gradients add up to the whole attention's, as in flash
  attention's backward pass. (splash's public call returns its log-sum-exp without a gradient, so a merge of blocks
  by it could not be differentiated through the kernel.) The backward entry point is a private one of jax's splash
  module (`has_splash_block_gradients`); where a jax lacks it the ring keeps the XLA blocks."""
  internals = _splash_internals()
  args = kernel.kwargs

  def collapsed(info):
    # As splash's own entry point does: partial mask blocks [heads, q blocks, kv blocks, bq, bkv] → [-1, bq, bkv].
    if info is None or info.partial_mask_blocks is None:
      return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:]))

  def one(q_segments_T, kv_segments_S, q_GTH, k_SH, v_SH, out_GTH, lse_GT, dout_GTH):
    ids = internals.SegmentIds(q=q_segments_T, kv=kv_segments_S)
    residuals = (q_GTH, k_SH, v_SH, ids, None, out_GTH, lse_GT)
    residuals += (collapsed(kernel.dq_mask_info), collapsed(kernel.dkv_mask_info))
    grads = internals._splash_attention_bwd(
      False,
      args["mask_value"],
      args["is_mqa"],
      args["block_sizes"],
      None,
      args["mask_function"],
      args["attn_logits_soft_cap"],
      args["interpret"],
      residuals,
      dout_GTH,
    )
    return grads[3:6]

  segments = (q_segments_BT, kv_segments_BS)
  return _per_sequence_and_kv_head(one, segments, q_BKGTH, k_BKSH, v_BKSH, out_BKGTH, lse_BKGT, dout_BKGTH)


def has_splash_block_gradients() -> bool:
  """Whether this jax has the splash backward entry point `splash_block_gradients` calls."""
  return _splash_internals() is not None


def _splash_internals():
  """jax's splash kernel module, for its backward entry point (`splash_block_gradients`), or None without it."""
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  except ImportError:
    return None
  return splash_attention_kernel if hasattr(splash_attention_kernel, "_splash_attention_bwd") else None


def kernel_layout(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array) -> tuple[Array, Array, Array]:
  """Queries [B, K, G, T, H], scaled, and keys and values [B, K, S, H]: splash's layout (the kernel attends one kv
  head's group of query heads at a time and does not scale the scores)."""
  batch, q_len, _, head_dim = q_BTNH.shape
  n_kv_heads = k_BSKH.shape[2]
  scaled_BTNH = q_BTNH * jnp.asarray(1.0 / np.sqrt(head_dim), q_BTNH.dtype)
  q_BKGTH = scaled_BTNH.reshape(batch, q_len, n_kv_heads, -1, head_dim).transpose(0, 2, 3, 1, 4)
  return q_BKGTH, k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)


def from_kernel_layout(out_BKGTH: Array, like_BTNH: Array) -> Array:
  """The inverse of `kernel_layout` for the output: [B, T, N, H] in the queries' dtype."""
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(like_BTNH.shape).astype(like_BTNH.dtype)


def splash_per_device(
  kernel, q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, q_segments_BT: Array | None, kv_segments_BS: Array | None
) -> Array:
  """`kernel` (`splash_kernel`) on one device's arrays, vmapped over batch and kv heads (`kernel_layout`)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  def one(q_segments_T, kv_segments_S, q_GTH, k_SH, v_SH):
    ids = None if q_segments_T is None else splash.SegmentIds(q=q_segments_T, kv=kv_segments_S)
    return kernel(q_GTH, k_SH, v_SH, segment_ids=ids)

  arrays = kernel_layout(q_BTNH, k_BSKH, v_BSKH)
  return from_kernel_layout(_per_sequence_and_kv_head(one, (q_segments_BT, kv_segments_BS), *arrays), q_BTNH)


def _per_sequence_and_kv_head(one, segments: tuple[Array | None, Array | None], *arrays_BK: Array):
  """`one(q_segments_T, kv_segments_S, *arrays)` on each sequence and kv head: the splash kernel works on one at a
  time. `arrays_BK` are [B, K, ...] (`kernel_layout`); the segment ids [B, T] / [B, S], or None, are shared by a
  sequence's heads."""
  seg_axis = None if segments[0] is None else 0
  per_head = jax.vmap(one, in_axes=(None, None) + (0,) * len(arrays_BK))
  return jax.vmap(per_head, in_axes=(seg_axis, seg_axis) + (0,) * len(arrays_BK))(*segments, *arrays_BK)
