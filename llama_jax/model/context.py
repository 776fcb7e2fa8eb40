"""Context parallelism: causal self-attention with every sequence split over the active mesh's context axes (the
mesh axes the rules map "activation_length" to), each device holding one slice and running under ``shard_map``,
batch and heads split as the activations' rules say. Axis letters: llama.py's legend. T is the whole sequence in
`context_attention` and a device's slice of it (T/n tokens of n devices) in the functions each device runs.

Strategies (``model.context_strategy``):
- "all_gather": each device gathers the whole sequence's keys, values and segment ids (one all-gather per layer,
  reduce-scattered in the backward pass) and attends its T/n queries to them, masked by global index: [T/n, T]
  scores, 1/n of the unsplit [T, T], every device the same work.
- "ring": each device keeps its T/n queries and passes its block of keys and values on to the next device
  (``ppermute``), one block per step for n steps, merging each block's softmax online (running max and sum, as flash
  attention does); [T/n, T/n] scores per step and two blocks of keys alive, whatever n. Device i holds tokens
  [i·T/n, (i+1)·T/n), so under the causal mask half of all blocks are invisible; every device still computes every
  block (the mask applied, static shapes), or the devices holding late tokens would keep the others waiting.
- "zigzag": the ring on the zigzag layout, in which the sequence is cut into 2n chunks and device i holds chunks i
  and 2n-1-i (one early, one late). Every device then has the same visible work at every step, and only that is
  computed: after its own block, a device attends all its queries to the first half of a block from an earlier
  device, or its late chunk's queries to the whole block from a later device: half a block's scores per step, n+1
  blocks' worth per layer instead of the ring's 2n. ``Llama.forward`` puts tokens, positions and segment ids in this
  layout once per step (`to_zigzag`) and its residual stream back (`from_zigzag`): between them every other layer
  is per token, and attention masks by the tokens' own indices, so the numbers are the natural layout's.

Kernels (`slice_kernel`): on TPU, splash, when what it attends at once is a whole number of splash blocks and the
head dim a multiple of 64 (as without context parallelism). With "all_gather" each device's queries attend the
gathered keys, the kernel's mask tables split by query rows over the context axes, so each device computes only its
rows' visible blocks. With "ring" and "zigzag" splash computes each block and the blocks merge by the kernel's
log-sum-exp; splash gives that no gradient, so `splash_ring` writes the backward pass, a second trip round the ring
with splash's backward kernels given the whole rows' output and log-sum-exp. Otherwise the XLA kernel runs, by query
chunks when the sequence is LONG_SEQUENCE tokens or more (`attention.map_query_chunks`). cuDNN's causal mask is
aligned to the first key, so it cannot mask a slice of the queries against the gathered keys: no cuDNN inside a
context slice (GPU: the XLA blocks).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.core.model_config import CONTEXT_STRATEGIES, unsupported_context_kernel
from llama_jax.model import attention as attention_lib
from llama_jax.model import sharding

Array = jax.Array


def slice_kernel(requested: str, backend: str, *, strategy: str, seq_len: int, shards: int, head_dim: int) -> str:
  """The kernel inside each device's slice: "splash" on TPU (`requested` auto or splash, head dim a multiple of 64)
  when what it attends at once is a whole number of splash blocks: the slice (all_gather, ring) or half a slice
  (zigzag's blocks after its own), and for the ring and zigzag this jax has splash's backward entry point
  (`attention.has_splash_block_gradients`); otherwise "xla" (the XLA blocks)."""
  piece = seq_len // shards // (2 if strategy == "zigzag" else 1)
  splash = (
    requested in ("auto", "splash")
    and backend == "tpu"
    and piece % attention_lib.SPLASH_BLOCK == 0
    and head_dim % 64 == 0
    and (strategy == "all_gather" or attention_lib.has_splash_block_gradients())
  )
  return "splash" if splash else "xla"


def splash_ring(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, segments_BT: Array, *, zigzag: bool, interpret: bool):
  """The ring (or zigzag) of one device under ``shard_map`` with splash on every block: the same blocks as the XLA
  ring computes (`context_attention`'s ring), each block's output and log-sum-exp from the kernel merged by their
  log-sum-exps. splash gives its log-sum-exp no gradient, so the backward pass is written here: the blocks go round
  the ring once more, each with the gradients of its keys and values so far, and splash's backward kernels give
  each block's share given the whole rows' output and log-sum-exp (`attention.splash_block_gradients`); after the
  last step the key and value gradients move on once more, to the device that holds their block. Kept for the
  backward pass: this device's queries, keys, values, output and log-sum-exp, no block's scores or partial output.

  Blocks: step 0 is the device's own block, causal (also in the zigzag layout, where the device's early chunk
  precedes its late one). After it every visible pair is whole: the ring attends all queries to a block from an
  earlier device and ignores one from a later device (computed, its log-sum-exp set to -inf: the step waits for the
  slowest device anyway); zigzag attends its late chunk's queries to the early half of every block, and either its
  early queries to the early half (an earlier device) or its late queries to the late half (a later one)."""
  axes, shards = sharding.context_axes()
  block = q_BTNH.shape[1]
  half = block // 2
  groups = q_BTNH.shape[2] // k_BSKH.shape[2]
  own = attention_lib.splash_kernel(groups, block, block, save_residuals=True, interpret=interpret)
  length = half if zigzag else block
  whole = attention_lib.splash_kernel(groups, length, length, causal=False, save_residuals=True, interpret=interpret)
  to_next = [(i, (i + 1) % shards) for i in range(shards)]

  def pieces(step, index):
    """(kernel: 0 own or 1 whole, first query row, first key, visible) of each product step `step` computes on
    device `index`."""
    if step == 0:
      return [(0, 0, 0, True)]
    source = (index - step) % shards
    if not zigzag:
      return [(1, 0, 0, source < index)]
    same = jnp.where(source < index, 0, half)
    return [(1, half, 0, True), (1, same, same, True)]

  def cut(x, start, axis, which):
    """The rows (or keys) of `x` from `start` that kernel `which` attends, on `axis`."""
    return jax.lax.dynamic_slice_in_dim(x, start, (block, length)[which], axis)

  def product(kernels, which, row, col, q_BKGTH, kv, segments_BT):
    """The splash arguments of one product: kernel `which`, the queries from `row` and the held block's keys and
    values from `col`, with their segment ids."""
    piece_k_BKSH, piece_v_BKSH, piece_kv_segments_BS = (cut(x, col, axis, which) for x, axis in zip(kv, (2, 2, 1)))
    piece_q_BKGTH, piece_segments_BT = cut(q_BKGTH, row, 3, which), cut(segments_BT, row, 1, which)
    return kernels[which], piece_q_BKGTH, piece_k_BKSH, piece_v_BKSH, piece_segments_BT, piece_kv_segments_BS

  def add(x, part, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(
      x, jax.lax.dynamic_slice_in_dim(x, start, part.shape[axis], axis) + part, start, axis
    )

  def forward(kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT):
    index = jax.lax.axis_index(axes)
    kv = (k_BKSH, v_BKSH, segments_BT)
    for step in range(shards):
      if step < shards - 1:
        next_kv = tuple(jax.lax.ppermute(x, axes, to_next) for x in kv)  # in flight during this step's products
      for which, row, col, visible in pieces(step, index):
        piece_out_BKGTH, piece_lse_BKGT = attention_lib.splash_with_lse(
          *product(kernels, which, row, col, q_BKGTH, kv, segments_BT)
        )
        if step == 0:
          out_BKGTH, lse_BKGT = piece_out_BKGTH.astype(jnp.float32), piece_lse_BKGT
          continue
        piece_lse_BKGT = jnp.where(visible, piece_lse_BKGT, -jnp.inf)
        running_out_BKGTH, running_lse_BKGT = cut(out_BKGTH, row, 3, which), cut(lse_BKGT, row, 3, which)
        merged_lse_BKGT = jnp.logaddexp(running_lse_BKGT, piece_lse_BKGT)
        running_out_BKGTH = (
          running_out_BKGTH * jnp.exp(running_lse_BKGT - merged_lse_BKGT)[..., None]
          + piece_out_BKGTH.astype(jnp.float32) * jnp.exp(piece_lse_BKGT - merged_lse_BKGT)[..., None]
        )
        out_BKGTH = jax.lax.dynamic_update_slice_in_dim(out_BKGTH, running_out_BKGTH, row, 3)
        lse_BKGT = jax.lax.dynamic_update_slice_in_dim(lse_BKGT, merged_lse_BKGT, row, 3)
      if step < shards - 1:
        # The next block's products wait for this one's merge: otherwise the compiler ran every step's kernel first
        # and kept each block's output and 128-lane log-sum-exp alive at once (BENCHMARKS.md, "Figures behind the
        # code").
        (out_BKGTH, lse_BKGT), kv = jax.lax.optimization_barrier(((out_BKGTH, lse_BKGT), next_kv))
    return out_BKGTH.astype(q_BKGTH.dtype), lse_BKGT

  # The kernels are arguments (pytrees of their mask tables), not closed over: made while tracing the forward pass,
  # their arrays are that trace's values, which the backward pass, traced later, gets as residuals.
  @jax.custom_vjp
  def attend(kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT):
    return forward(kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT)[0]

  def attend_forward(kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT):
    out_BKGTH, lse_BKGT = forward(kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT)
    return out_BKGTH, (kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT, out_BKGTH, lse_BKGT)

  def attend_backward(residuals, dout_BKGTH):
    kernels, q_BKGTH, k_BKSH, v_BKSH, segments_BT, out_BKGTH, lse_BKGT = residuals
    index = jax.lax.axis_index(axes)
    dq_BKGTH = jnp.zeros(q_BKGTH.shape, jnp.float32)
    kv = (k_BKSH, v_BKSH, segments_BT)
    dkv = (jnp.zeros(k_BKSH.shape, jnp.float32), jnp.zeros(v_BKSH.shape, jnp.float32))
    for step in range(shards):
      if step < shards - 1:
        next_kv = tuple(jax.lax.ppermute(x, axes, to_next) for x in kv)
      for which, row, col, visible in pieces(step, index):
        grads = attention_lib.splash_block_gradients(
          *product(kernels, which, row, col, q_BKGTH, kv, segments_BT),
          cut(out_BKGTH, row, 3, which),
          cut(lse_BKGT, row, 3, which),
          cut(dout_BKGTH, row, 3, which),
        )
        piece_dq_BKGTH, piece_dk_BKSH, piece_dv_BKSH = (jnp.where(visible, g, 0).astype(jnp.float32) for g in grads)
        dq_BKGTH = add(dq_BKGTH, piece_dq_BKGTH, row, 3)
        dkv = (add(dkv[0], piece_dk_BKSH, col, 2), add(dkv[1], piece_dv_BKSH, col, 2))
      dkv = tuple(jax.lax.ppermute(x, axes, to_next) for x in dkv)
      if step < shards - 1:
        dq_BKGTH, kv = jax.lax.optimization_barrier((dq_BKGTH, next_kv))  # as in the forward pass
    # No cotangents for the kernels' mask tables and the (integer) segment ids.
    return None, dq_BKGTH.astype(q_BKGTH.dtype), dkv[0].astype(k_BKSH.dtype), dkv[1].astype(v_BKSH.dtype), None

  attend.defvjp(attend_forward, attend_backward)
  q_BKGTH, k_BKSH, v_BKSH = attention_lib.kernel_layout(q_BTNH, k_BSKH, v_BSKH)
  return attention_lib.from_kernel_layout(attend((own, whole), q_BKGTH, k_BKSH, v_BKSH, segments_BT), q_BTNH)


class Slices(NamedTuple):
  """How `context_attention` cut the sequence: what each strategy's per-device function needs besides its arrays."""

  axes: tuple[str, ...]  # the context mesh axes
  shards: int  # devices along them
  q_len: int  # the whole sequence's length
  block: int  # q_len / shards, each device's tokens
  head_dim: int
  chunk: int | None  # query rows attended at a time (rematerialised), or None for a whole slice at once
  zigzag: bool  # the zigzag layout (device i holds chunks i and 2n-1-i of 2n)


def context_attention(
  q_BTNH: Array,
  k_BSKH: Array,
  v_BSKH: Array,
  *,
  segment_ids: Array | None = None,
  strategy: str = "all_gather",
  implementation: str = "auto",
  interpret: bool = False,
) -> Array:
  """Causal self-attention (T == S) of a sequence split over the active mesh's context axes.

  Each device runs one strategy's function under ``shard_map`` on its slice: `gathered_xla`, `gathered_splash`,
  `ring_xla` or `splash_ring` (module docstring), chosen by `strategy` and the kernel `slice_kernel` picks.

  Args:
    q_BTNH: queries.
    k_BSKH: keys.
    v_BSKH: values.
    segment_ids: [B, T] document ids of packed sequences (None: one document per row).
    strategy: "all_gather", "ring" or "zigzag"; "zigzag" takes and returns the zigzag layout (`to_zigzag`), the
      others the natural one.
    implementation: model.attention (`slice_kernel` chooses the kernel inside each slice from it).
    interpret: choose the kernel as on TPU and run splash, where chosen, by the Pallas interpreter on any backend
      (tests).

  Returns:
    The attention output, shaped as `q_BTNH`.

  Raises:
    ValueError: for an unknown strategy, or a kernel that cannot run inside a slice.
    sharding.ShardingError: when the context axes do not divide the sequence.
  """
  if strategy not in CONTEXT_STRATEGIES:
    raise ValueError(f"context strategy must be one of {', '.join(CONTEXT_STRATEGIES)}; got {strategy!r}")
  if (problem := unsupported_context_kernel(implementation, strategy)) is not None:
    raise ValueError(f"attention={implementation!r} cannot run inside a context slice: {problem}")
  axes, shards = sharding.context_axes()
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  kernel = slice_kernel(
    implementation,
    "tpu" if interpret else sharding.target_platform(),  # the interpreter runs the TPU kernel on any backend
    strategy=strategy,
    seq_len=q_len,
    shards=shards,
    head_dim=head_dim,
  )
  pieces = 2 * shards if strategy == "zigzag" else shards
  if q_len % pieces:
    raise sharding.ShardingError(
      f"the context axes {'×'.join(axes)} with strategy {strategy!r} cut sequences into {pieces} pieces, which "
      f"does not divide their {q_len} tokens"
    )
  block = q_len // shards
  if segment_ids is None:
    segment_ids = jnp.ones((batch, q_len), jnp.int32)  # one segment: the mask is causal only

  # Long sequences attend by query chunks of each slice, one at a time and rematerialised (as "chunked" does from
  # LONG_SEQUENCE on): scores of `chunk` rows alive instead of the slice's. By the sequence's length, not the
  # slice's: unchunked short slices of a long sequence held more temporaries per device than chunked longer ones
  # (BENCHMARKS.md, "Figures behind the code"). Zigzag merges half slices too, so its chunk divides half a slice.
  chunk = attention_lib.chunk_size(block) if q_len >= attention_lib.LONG_SEQUENCE else None
  if chunk is not None and strategy == "zigzag" and (block // 2) % chunk:
    chunk = attention_lib.chunk_size(block // 2)
  slices = Slices(axes, shards, q_len, block, head_dim, chunk, zigzag=strategy == "zigzag")

  specs = sharding.active_specs(
    {
      "q": ("activation_batch", "activation_length", "activation_heads", None),
      "kv": ("activation_batch", "activation_length", "activation_kv_heads", None),
      "seg": ("activation_batch", "activation_length"),
    }
  )
  if kernel == "splash" and strategy == "all_gather":
    # Each device's queries against the gathered keys by global index: the kernel's mask tables, made for the whole
    # [T, T] causal mask, travel split by query rows over the context axes.
    splash = attention_lib.splash_kernel(
      n_heads // k_BSKH.shape[2], q_len, q_len, q_seq_shards=shards, interpret=interpret
    )
    mask_spec = splash.manual_sharding_spec(
      jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec(None, axes))
    )
    run = jax.shard_map(
      functools.partial(gathered_splash, slices),
      in_specs=(mask_spec, specs["q"], specs["kv"], specs["kv"], specs["seg"]),
      out_specs=specs["q"],
      check_vma=False,
    )
    return run(splash, q_BTNH, k_BSKH, v_BSKH, segment_ids)
  if strategy == "all_gather":
    per_device = functools.partial(gathered_xla, slices)
  elif kernel == "splash":  # the ring's or zigzag's blocks by splash
    per_device = functools.partial(splash_ring, zigzag=slices.zigzag, interpret=interpret)
  else:
    per_device = functools.partial(ring_xla, slices)
  run = jax.shard_map(
    per_device,
    in_specs=(specs["q"], specs["kv"], specs["kv"], specs["seg"]),
    out_specs=specs["q"],
    check_vma=False,
  )
  return run(q_BTNH, k_BSKH, v_BSKH, segment_ids)


def gathered_xla(s: Slices, q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, segments_BT: Array) -> Array:
  """ "all_gather" by the XLA kernel, on one device: its slice's queries against the whole gathered sequence, masked
  by global index (by query chunks when `s.chunk`)."""
  first = jax.lax.axis_index(s.axes) * s.block
  all_k_BSKH, all_v_BSKH, all_segments_BS = (_all_gather(x, s.axes) for x in (k_BSKH, v_BSKH, segments_BT))
  kv_positions_BS = jnp.broadcast_to(jnp.arange(s.q_len, dtype=jnp.int32), all_segments_BS.shape)

  def attend(q_BTNH, segments_BT, start):
    q_positions_BT = jnp.broadcast_to(start + jnp.arange(q_BTNH.shape[1], dtype=jnp.int32), segments_BT.shape)
    return attention_lib.xla_attention(
      q_BTNH,
      all_k_BSKH,
      all_v_BSKH,
      q_segment_ids=segments_BT,
      kv_segment_ids=all_segments_BS,
      q_positions=q_positions_BT,
      kv_positions=kv_positions_BS,
    )

  if s.chunk is None:
    return attend(q_BTNH, segments_BT, first)
  return attention_lib.map_query_chunks(attend, q_BTNH, segments_BT, s.chunk, first)


def gathered_splash(s: Slices, splash, q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, segments_BT: Array) -> Array:
  """ "all_gather" by splash, on one device: its queries against the gathered keys, by the kernel's share of the
  mask tables (`splash`); the keys' and values' gradients reduce-scattered to their slices (`_gather_slices`)."""
  all_segments_BS = _all_gather(segments_BT, s.axes)
  all_k_BSKH, all_v_BSKH = (_gather_slices(x, s.axes, s.shards) for x in (k_BSKH, v_BSKH))
  return attention_lib.splash_per_device(splash, q_BTNH, all_k_BSKH, all_v_BSKH, segments_BT, all_segments_BS)


def _token_index(s: Slices, device: Array) -> Array:
  """The global indices [T] of the tokens a device holds (T: its slice)."""
  if not s.zigzag:
    return device * s.block + jnp.arange(s.block, dtype=jnp.int32)
  half = jnp.arange(s.block // 2, dtype=jnp.int32)
  return jnp.concatenate([device * (s.block // 2) + half, (2 * s.shards - 1 - device) * (s.block // 2) + half])


def _merge_rows(head_dim: int, rows, k_BSKH, v_BSKH, kv_segments_BS, kv_index_S):
  """One block of keys merged into some query rows' running (max, sum, output) [B, K, G, T(, H)]."""
  q_BTKGH, q_index_BT, segments_BT, (max_BKGT, sum_BKGT, out_BKGTH) = rows
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  scores_BKGTS = scores_BKGTS * (1.0 / np.sqrt(head_dim))
  visible_BTS = (kv_index_S[None, None, :] <= q_index_BT[:, :, None]) & (
    segments_BT[:, :, None] == kv_segments_BS[:, None, :]
  )
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, attention_lib.MASK_VALUE)
  new_max_BKGT = jnp.maximum(max_BKGT, scores_BKGTS.max(axis=-1))
  probs_BKGTS = jnp.exp(scores_BKGTS - new_max_BKGT[..., None])
  rescale_BKGT = jnp.exp(max_BKGT - new_max_BKGT)
  sum_BKGT = sum_BKGT * rescale_BKGT + probs_BKGTS.sum(axis=-1)
  out_BKGTH = out_BKGTH * rescale_BKGT[..., None] + jnp.einsum(
    "BKGTS,BSKH->BKGTH", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH, preferred_element_type=jnp.float32
  )
  return new_max_BKGT, sum_BKGT, out_BKGTH


def _merge(s: Slices, rows, *kv):
  """`_merge_rows`, by query chunks (axis 1 of q, ids and positions; axis 3 of the running state), one at a time,
  when the sequence is long."""
  if s.chunk is None:
    return _merge_rows(s.head_dim, rows, *kv)
  n, chunk = rows[0].shape[1] // s.chunk, s.chunk
  split = lambda x, axis: jnp.moveaxis(x.reshape(*x.shape[:axis], n, chunk, *x.shape[axis + 1 :]), axis, 0)  # noqa: E731
  joined = lambda x, axis: jnp.moveaxis(x, 0, axis).reshape(*x.shape[1 : axis + 1], -1, *x.shape[axis + 2 :])  # noqa: E731
  q_BTKGH, q_index_BT, segments_BT, running = rows
  chunks = (split(q_BTKGH, 1), split(q_index_BT, 1), split(segments_BT, 1), tuple(split(r, 3) for r in running))
  merged = jax.lax.map(jax.checkpoint(lambda rows: _merge_rows(s.head_dim, rows, *kv)), chunks)
  return tuple(joined(r, 3) for r in merged)


# Each block's merge is rematerialised in the backward pass: only the running (max, sum, output) of each step are
# kept, not its [T, S] scores (BENCHMARKS.md, "Figures behind the code").
@functools.partial(jax.checkpoint, static_argnums=(0, 1))
def _merge_block(s: Slices, step: int, index, queries, running, k_BSKH, v_BSKH, kv_segments_BS):
  """Step `step` of the ring on device `index`: the block of keys that came from `step` devices back merged into
  this device's `queries` (q [B, T, K, G, H], their global indices and segment ids) and `running` state."""
  q_BTKGH, q_index_BT, segments_BT = queries
  # Step 0 is the device's own block, where every query sees itself: the running max is a real score from then on,
  # so a later fully masked block adds exp(MASK_VALUE - max) = 0.
  source = (index - step) % s.shards
  kv = (k_BSKH, v_BSKH, kv_segments_BS, _token_index(s, source))
  if not s.zigzag or step == 0:
    return _merge(s, (q_BTKGH, q_index_BT, segments_BT, running), *kv)
  # From an earlier device (source < index) the visible half is its early chunk against all this device's queries;
  # from a later one, its whole block against this device's late chunk. Both are two merges of half the queries
  # against half the keys, with one in common, the late queries against the early keys; the other pairs early queries
  # with early keys, or late with late: the same slice offset of queries and keys, chosen on device. (A lax.cond
  # between the two cases kept both cases' residuals for the backward pass: BENCHMARKS.md, "Figures behind the code".)
  half = s.block // 2

  def merge_slice(running, row_start, kv_start):
    rows_at = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, row_start, half, axis)  # noqa: E731
    rows = (rows_at(q_BTKGH, 1), rows_at(q_index_BT, 1), rows_at(segments_BT, 1), [rows_at(r, 3) for r in running])
    keys = [jax.lax.dynamic_slice_in_dim(x, kv_start, half, 1) for x in (k_BSKH, v_BSKH, kv_segments_BS)]
    merged = _merge(s, rows, *keys, jax.lax.dynamic_slice_in_dim(kv[3], kv_start, half))
    return tuple(jax.lax.dynamic_update_slice_in_dim(r, m, row_start, 3) for r, m in zip(running, merged))

  running = merge_slice(running, half, 0)
  same = jnp.where(source < index, 0, half)
  return merge_slice(running, same, same)


def ring_xla(s: Slices, q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, segments_BT: Array) -> Array:
  """ "ring" or "zigzag" by the XLA kernel, on one device: its queries stay, the blocks of keys and values go round
  the ring, each merged into the running softmax (`_merge_block`)."""
  index = jax.lax.axis_index(s.axes)
  b, n_kv_heads = q_BTNH.shape[0], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, s.block, n_kv_heads, -1, s.head_dim)
  groups = q_BTKGH.shape[3]
  queries = (q_BTKGH, jnp.broadcast_to(_token_index(s, index), segments_BT.shape), segments_BT)
  to_next = [(i, (i + 1) % s.shards) for i in range(s.shards)]
  # Running max, softmax denominator and unnormalised output of each query row, in float32.
  running = (
    jnp.full((b, n_kv_heads, groups, s.block), attention_lib.MASK_VALUE, jnp.float32),
    jnp.zeros((b, n_kv_heads, groups, s.block), jnp.float32),
    jnp.zeros((b, n_kv_heads, groups, s.block, s.head_dim), jnp.float32),
  )
  kv = (k_BSKH, v_BSKH, segments_BT)
  for step in range(s.shards):
    running = _merge_block(s, step, index, queries, running, *kv)
    if step < s.shards - 1:
      kv = tuple(jax.lax.ppermute(x, s.axes, to_next) for x in kv)
  _, sum_BKGT, out_BKGTH = running
  out_BKGTH = out_BKGTH / sum_BKGT[..., None]
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(q_BTNH.shape).astype(q_BTNH.dtype)


def _all_gather(x: Array, axes: tuple[str, ...]) -> Array:
  return jax.lax.all_gather(x, axes, axis=1, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_slices(x: Array, axes: tuple[str, ...], shards: int) -> Array:
  """The all-gather of a device's slice [B, slice, ...] into [B, S, ...] (under ``shard_map``) whose gradient is
  reduce-scattered over a new leading axis of the `shards` slices, [shards, B, slice, ...], rather than over the
  sequence axis in place: the TPU compiler turns a reduce-scatter whose dimension is not the operand's major one into
  an all-reduce of the whole sequence and a slice, which it did for splash's key and value gradients (the kernel lays
  out heads before positions). The XLA blocks keep the plain all-gather, whose reduce-scatters this one made larger
  (BENCHMARKS.md, "Figures behind the code")."""
  return _all_gather(x, axes)


def _gather_slices_fwd(x: Array, axes: tuple[str, ...], shards: int) -> tuple[Array, None]:
  return _all_gather(x, axes), None


def _gather_slices_bwd(axes: tuple[str, ...], shards: int, _, g_BS: Array) -> tuple[Array]:
  batch, length, *rest = g_BS.shape
  g_slices = jnp.moveaxis(g_BS.reshape(batch, shards, length // shards, *rest), 1, 0)
  return (jax.lax.psum_scatter(g_slices, axes, scatter_dimension=0, tiled=False),)


_gather_slices.defvjp(_gather_slices_fwd, _gather_slices_bwd)


def _home(chunk: int, shards: int) -> int:
  """The device that holds `chunk` (of 2·shards) in the zigzag layout: chunk i and chunk 2n-1-i on device i."""
  return chunk if chunk < shards else 2 * shards - 1 - chunk


def _move_chunks(x: Array | None, logical_axes: tuple[str | None, ...], inverse: bool) -> Array | None:
  """`x` [B, T, ...], split over the context axes on its axis 1, from the natural layout (device d holds chunks 2d
  and 2d+1) to the zigzag layout (device i holds chunks i and 2n-1-i), or back with `inverse`. Two ``ppermute``s of
  half a slice each: every device's even chunk goes to one device and its odd chunk to another, and both sets of
  destinations are permutations (chunk i and chunk 2n-1-i differ in parity)."""
  axes, shards = sharding.context_axes()
  if x is None or shards == 1:
    return x
  if x.shape[1] % (2 * shards):
    raise sharding.ShardingError(
      f"the zigzag layout cuts sequences into {2 * shards} chunks, which does not divide their {x.shape[1]} tokens"
    )
  even = [(d, _home(2 * d, shards)) for d in range(shards)]
  odd = [(d, _home(2 * d + 1, shards)) for d in range(shards)]
  if inverse:
    even, odd = [(b, a) for a, b in even], [(b, a) for a, b in odd]

  def local(x_BT):
    half = x_BT.shape[1] // 2
    first, second = x_BT[:, :half], x_BT[:, half:]
    # On an even device of the zigzag layout the early chunk is the even one; on an odd device, the odd one.
    even_device = jax.lax.axis_index(axes) % 2 == 0
    if inverse:
      first, second = jnp.where(even_device, first, second), jnp.where(even_device, second, first)
    moved_even, moved_odd = jax.lax.ppermute(first, axes, even), jax.lax.ppermute(second, axes, odd)
    if not inverse:
      moved_even, moved_odd = (
        jnp.where(even_device, moved_even, moved_odd),
        jnp.where(even_device, moved_odd, moved_even),
      )
    return jnp.concatenate([moved_even, moved_odd], axis=1)

  spec = sharding.active_specs({"x": logical_axes})["x"]
  return jax.shard_map(local, in_specs=(spec,), out_specs=spec, check_vma=False)(x)


def to_zigzag(x: Array | None, logical_axes: tuple[str | None, ...]) -> Array | None:
  """`x` [B, T, ...] (sharded by `logical_axes`, T as "activation_length") in the zigzag layout; unchanged when the
  sequence is not split."""
  return _move_chunks(x, logical_axes, inverse=False)


def from_zigzag(x: Array | None, logical_axes: tuple[str | None, ...]) -> Array | None:
  """The inverse of `to_zigzag`."""
  return _move_chunks(x, logical_axes, inverse=True)
