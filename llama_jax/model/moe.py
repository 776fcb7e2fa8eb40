"""Mixture of experts: routing, the three ways to run the experts, and the router statistics the losses need.

Array functions only; the module holding the weights is ``llama.MoE``. Axis letters are llama.py's legend; the
other dimensions are spelled out: tokens (a call's B·T flattened), the top_k choices of a token, assignments (a
token's choice, tokens·top_k of them, sorted by expert where grouped), slots per expert (the capacity path), tiles
and their rows (the tiled grouped matmul), devices of the expert mesh axis. `x` is a call's tokens [tokens, D];
`choice_weights` and `choice_experts` [tokens, top_k] are each token's routing (`route`).

The experts run one of three ways (``MoEConfig.compute``), all equal up to float rounding (tests/model/test_moe.py):
- dropless: the assignments sorted by expert and multiplied by grouped matmuls (group e = the rows routed to
  expert e), no token dropped. The grouped matmul is ``jax.lax.ragged_dot`` (TPU and GPU kernels) or, on CPU, a
  tiled product: each group padded to whole tiles of rows, one [tile rows, D]·[D, F] product per tile in a scan.
  XLA:CPU computes ragged_dot as every group on every row, as slow as all experts on every token (BENCHMARKS.md,
  "Figures behind the code").
- capacity: each expert takes at most capacity_factor · assignments / E of a device's assignments (earlier tokens
  first), computed as one batched einsum over [E, slots, D]; the rest are dropped (their weight is lost, the residual
  carries the token) and their fraction reported. Static shapes throughout: GShard's expert capacity, what MaxText
  calls its dropping path.
- dense: every expert on every token, the outputs weighted by the routing weights (0 for experts not chosen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from llama_jax.core.model_config import MoEConfig
from llama_jax.model import sharding

Array = jax.Array

# Rows per tile of the tiled grouped matmul: at most this many (the product's efficient size on XLA:CPU), fewer when
# the assignments are few (a decode step's B·top_k rows would otherwise be padded to E whole tiles of 128).
MAX_TILE_ROWS = 128
MIN_TILE_ROWS = 8


def route(router_logits: Array, cfg: MoEConfig) -> tuple[Array, Array, Array]:
  """(weights [tokens, top_k] float32, experts [tokens, top_k] int32, probabilities [tokens, E] float32): softmax over
  the experts in float32, the top_k kept (ties to the lower expert id, as torch.topk), renormalised to sum to 1 when
  `normalize_top_k` (Mixtral)."""
  router_probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  choice_weights, choice_experts = jax.lax.top_k(router_probs, cfg.top_k)
  if cfg.normalize_top_k:
    choice_weights = choice_weights / jnp.sum(choice_weights, axis=-1, keepdims=True)
  return choice_weights, choice_experts.astype(jnp.int32), router_probs


def router_sums(
  router_logits: Array, router_probs: Array, choice_experts: Array, token_mask: Array | None
) -> dict[str, Array]:
  """One layer's sums over its (unmasked) tokens: `routed` [E] assignments per expert, `probability` [E] router
  probability per expert, `tokens`, `z` Σ logsumexp(logits)². Sums, not means: `balance_losses` divides them per
  layer, or once over all layers as transformers' load_balancing_loss_func does."""
  num_experts = router_probs.shape[-1]
  token_mask = jnp.ones(router_probs.shape[:1], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
  chosen = jax.nn.one_hot(choice_experts, num_experts, dtype=jnp.float32)  # [tokens, top_k, E]
  log_z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
  # m: tokens, j: top-k choices.
  return dict(
    routed=jnp.einsum("mjE,m->E", chosen, token_mask),
    probability=jnp.einsum("mE,m->E", router_probs, token_mask),
    tokens=jnp.sum(token_mask),
    z=jnp.sum(log_z * log_z * token_mask),
  )


def balance_losses(router: dict[str, Array], top_k: int, form: str = "per_layer") -> dict[str, Array]:
  """From the per-layer sums [L, ...] of `router_sums`: `balance` the load-balancing loss, E · Σ_e f_e · p_e with f_e
  and p_e the assignments and the probability mass of expert e, each divided by the token count (1.0 when perfectly
  balanced at top-1, top_k at top-k) — for each layer and averaged over layers (`form` "per_layer", Switch's
  definition per layer), or over the tokens of every layer together (`form` "transformers": transformers'
  load_balancing_loss_func, whose f_e and p_e add expert e of every layer); `z` the mean squared router
  log-normaliser; `load` [L, E] each layer's share of assignments per expert; `imbalance` the largest max/min ratio of
  a layer's assignment counts (an idle expert counted as 1 assignment, so the ratio stays finite in logs and JSON)."""
  num_experts = router["routed"].shape[-1]
  if form == "per_layer":
    tokens_L1 = jnp.maximum(router["tokens"], 1.0)[:, None]
    shares_LE = (router["routed"] / tokens_L1) * (router["probability"] / tokens_L1)
    balance = num_experts * jnp.mean(jnp.sum(shares_LE, axis=-1))
  else:
    tokens = jnp.maximum(jnp.sum(router["tokens"]), 1.0)
    routed_E = jnp.sum(router["routed"], axis=0) / tokens
    balance = num_experts * jnp.sum(routed_E * jnp.sum(router["probability"], axis=0) / tokens)
  load_LE = router["routed"] / jnp.maximum(router["tokens"][:, None] * top_k, 1.0)
  return dict(
    balance=balance,
    z=jnp.sum(router["z"]) / jnp.maximum(jnp.sum(router["tokens"]), 1.0),
    load=load_LE,
    imbalance=jnp.max(jnp.max(router["routed"], axis=-1) / jnp.maximum(jnp.min(router["routed"], axis=-1), 1.0)),
  )


def swiglu_experts(rows: Array, w_gate: Array, w_up: Array, w_down: Array, matmul) -> Array:
  """down(silu(gate(x)) · up(x)) of each row by its expert's weights, `matmul(rows, weights [E, in, out])` doing the
  grouping (the three paths differ only there)."""
  hidden = jax.nn.silu(matmul(rows, w_gate)) * matmul(rows, w_up)
  return matmul(hidden, w_down)


def dropless(
  x: Array, choice_weights: Array, choice_experts: Array, w_gate: Array, w_up: Array, w_down: Array, grouped: str
) -> Array:
  """Every assignment computed by its expert (grouped matmuls over the assignments sorted by expert) and the top-k
  outputs of each token summed with their weights. `grouped`: "ragged_dot" or "tiles" (module docstring)."""
  num_tokens, top_k = choice_experts.shape
  rows = jnp.repeat(x, top_k, axis=0)  # [assignments, D]: assignment a = token·top_k + choice
  out_rows = grouped_swiglu(rows, choice_experts.reshape(-1), w_gate, w_up, w_down, grouped)
  return combine(out_rows, choice_weights)


def combine(out_rows: Array, choice_weights: Array) -> Array:
  """Each token's output: its top_k assignments' outputs (rows token·top_k + choice) summed with their routing
  weights."""
  num_tokens, top_k = choice_weights.shape
  # m: tokens, j: top-k choices.
  return jnp.einsum("mjD,mj->mD", out_rows.reshape(num_tokens, top_k, -1), choice_weights.astype(out_rows.dtype))


def grouped_swiglu(rows: Array, row_experts: Array, w_gate: Array, w_up: Array, w_down: Array, grouped: str) -> Array:
  """Row a through expert row_experts[a]'s SwiGLU, the rows sorted by expert and run as groups. An id of E (or more)
  marks a row no expert takes (an empty slot of the expert-parallel exchange): it is sorted last, outside every
  group, and its output is not defined (zeros or whatever the product leaves); the caller never reads it."""
  num_experts = w_gate.shape[0]
  order = jnp.argsort(row_experts, stable=True)
  sorted_experts = jnp.take(row_experts, order)
  sizes_E = jnp.bincount(row_experts, length=num_experts).astype(jnp.int32)  # ids ≥ E are not counted
  rows = jnp.take(rows, order, axis=0)
  if grouped == "ragged_dot":
    out_rows = swiglu_experts(
      rows, w_gate, w_up, w_down, lambda x, w: jax.lax.ragged_dot(x, w.astype(x.dtype), sizes_E)
    )
  else:
    out_rows = _tiled_experts(rows, sizes_E, sorted_experts, w_gate, w_up, w_down)
  return jnp.zeros_like(out_rows).at[order].set(out_rows, unique_indices=True)


def rank_in_group(row_groups: Array, groups: int) -> Array:
  """For each row, how many earlier rows are in its group (0 for a group's first): its slot in a buffer per group
  (an expert's capacity, a destination device's send buffer), earlier rows first."""
  member = jax.nn.one_hot(row_groups, groups, dtype=jnp.int32)
  return jnp.sum((jnp.cumsum(member, axis=0) - 1) * member, axis=-1)


def tile_rows(assignments: int, num_experts: int) -> int:
  """Rows per tile: the fair share of assignments per expert rounded up to a power of two, within
  [MIN_TILE_ROWS, MAX_TILE_ROWS]."""
  share = max(1, -(-assignments // num_experts))
  return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, 1 << (share - 1).bit_length()))


def _tiled_experts(rows: Array, sizes_E: Array, sorted_experts: Array, w_gate, w_up, w_down) -> Array:
  """The grouped SwiGLU by tiles: group e's rows placed from a tile boundary, so every tile holds one expert's rows
  (and padding); at most assignments / tile_size + E tiles, a static bound. A scan runs one tile at a time, reading
  only its expert's weights, so no copy of the weights per tile is ever formed. Rows of no expert (id ≥ E) are left
  out."""
  assignments, dim = rows.shape
  num_experts = sizes_E.shape[0]
  tile_size = tile_rows(assignments, num_experts)
  num_tiles = assignments // tile_size + num_experts
  padded_E = (sizes_E + tile_size - 1) // tile_size * tile_size
  tile_end_E = jnp.cumsum(padded_E)
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  # Row of each sorted assignment in the tiled buffer: its group's first tile row plus its rank in the group; past
  # the buffer (dropped on the way in, zeros on the way out) for a row of no expert.
  taken = sorted_experts < num_experts
  clipped_experts = jnp.minimum(sorted_experts, num_experts - 1)
  row_slot = (tile_end_E - padded_E)[clipped_experts] + jnp.arange(assignments) - group_start_E[clipped_experts]
  row_slot = jnp.where(taken, row_slot, num_tiles * tile_size)
  x_tiles = jnp.zeros((num_tiles * tile_size, dim), rows.dtype).at[row_slot].set(rows, mode="drop")
  x_tiles = x_tiles.reshape(num_tiles, tile_size, dim)  # [tiles, tile_size, D]
  # Expert of each tile; tiles past the last group hold only padding and run expert E-1 on zeros.
  tile_experts = jnp.minimum(
    jnp.searchsorted(tile_end_E, jnp.arange(num_tiles) * tile_size, side="right"), num_experts - 1
  )

  def one_tile(_, tile):
    x_tile, expert = tile
    return None, swiglu_experts(
      x_tile, w_gate[expert], w_up[expert], w_down[expert], lambda x, w: x @ w.astype(x.dtype)
    )

  _, out_tiles = jax.lax.scan(one_tile, None, (x_tiles, tile_experts))
  return jnp.take(out_tiles.reshape(num_tiles * tile_size, -1), row_slot, axis=0, mode="fill", fill_value=0)


def expert_parallel(
  x: Array,
  choice_weights: Array,
  choice_experts: Array,
  w_gate: Array,
  w_up: Array,
  w_down: Array,
  *,
  grouped: str,
  axis: str = "expert",
) -> Array:
  """The dropless output [tokens, D] with the experts sharded over mesh axis `axis` (E / devices experts per device):
  called per device (inside shard_map), on this device's tokens and its own experts.

  Each assignment goes to the device holding its expert: rows packed per destination into a send buffer [devices,
  assignments, D] (a slot for every assignment of the device per destination, since all of them may go to one:
  nothing is dropped, and the buffer is devices times the rows sent), one all_to_all there and one back; a device
  runs what it receives grouped by its local experts. (`capacity` with an axis sends at most its expert capacity
  instead.) The dense all_to_all with fixed slots runs everywhere; XLA:CPU has no ragged all-to-all ("UNIMPLEMENTED:
  HLO opcode ragged-all-to-all"), so the 8-device equality tests could not run one."""
  num_tokens, top_k = choice_experts.shape
  slots = num_tokens * top_k
  local_experts = w_gate.shape[0]
  devices = jax.lax.axis_size(axis)
  row_experts = choice_experts.reshape(-1)
  destination = row_experts // local_experts
  row_slot = destination * slots + rank_in_group(destination, devices)
  send_x = jnp.zeros((devices * slots, x.shape[-1]), x.dtype).at[row_slot].set(jnp.repeat(x, top_k, axis=0))
  # An empty slot keeps the id of no local expert.
  send_expert = jnp.full((devices * slots,), local_experts, jnp.int32).at[row_slot].set(row_experts % local_experts)

  def exchange(rows):
    return jax.lax.all_to_all(rows.reshape(devices, slots, *rows.shape[1:]), axis, 0, 0, tiled=True).reshape(rows.shape)

  received_out = grouped_swiglu(exchange(send_x), exchange(send_expert), w_gate, w_up, w_down, grouped)
  return combine(jnp.take(exchange(received_out), row_slot, axis=0), choice_weights)


EXPERT_AXIS = "expert"


def expert_devices() -> int:
  """Size of the active mesh's expert axis (1 with no mesh, or no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)


def _mesh_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_experts(
  x: Array,
  choice_weights: Array,
  choice_experts: Array,
  experts: Sequence[Array],
  expert_axes: Sequence[Sequence[str | None]],
  *,
  grouped: str,
  capacity_factor: float | None,
) -> tuple[Array, Array]:
  """(output [tokens, D], fraction dropped) of the experts run on every device of the active mesh: `expert_parallel`
  (dropless), or `capacity` with `capacity_factor`, over the expert axis, inside a shard_map manual over the batch's
  mesh axes and the expert axis (tokens stay where they are; a device's expert weights arrive whole but for the
  `tensor` split, which the compiler keeps). `experts` are (w_gate, w_up, w_down) with their logical axes
  `expert_axes`; the mesh mapping comes from the active logical axis rules, whose "expert" must be the expert mesh
  axis."""
  rules = sharding.active_rules()
  batch_axes = _mesh_axes(sharding.logical_to_spec(("activation_batch",), rules)[0])
  manual = set(batch_axes) | {EXPERT_AXIS}
  weight_specs = []
  for logical in expert_axes:
    spec = sharding.logical_to_spec(logical, rules)
    if _mesh_axes(spec[0]) != (EXPERT_AXIS,):
      raise sharding.ShardingError(
        f"expert parallelism needs the logical axis 'expert' mapped to the mesh axis {EXPERT_AXIS!r}, got {spec[0]!r}"
      )
    weight_specs.append(PartitionSpec(*(tuple(a for a in _mesh_axes(e) if a in manual) or None for e in spec)))
  rows = PartitionSpec(batch_axes or None)

  def per_device(x, choice_weights, choice_experts, *local):
    # Dims other than the expert axis split over a manual axis (fsdp's "embed") are gathered, as FSDP gathers a
    # layer's weights; its backward is the reduce-scatter of the gradients.
    whole = []
    for w, spec in zip(local, weight_specs):
      for dim, entry in list(enumerate(spec))[1:]:
        if entry:
          w = jax.lax.all_gather(w, entry, axis=dim, tiled=True)
      whole.append(w)
    if capacity_factor is None:
      y, dropped = expert_parallel(x, choice_weights, choice_experts, *whole, grouped=grouped), jnp.zeros(())
    else:
      y, dropped = capacity(x, choice_weights, choice_experts, *whole, capacity_factor, axis=EXPERT_AXIS)
    return y, jax.lax.pmean(dropped, tuple(sorted(manual)))

  return jax.shard_map(
    per_device,
    mesh=jax.sharding.get_abstract_mesh(),
    in_specs=(rows, rows, rows, *weight_specs),
    out_specs=(rows, PartitionSpec()),
    axis_names=manual,
    check_vma=False,
  )(x, choice_weights, choice_experts, *experts)


def capacity(
  x: Array,
  choice_weights: Array,
  choice_experts: Array,
  w_gate: Array,
  w_up: Array,
  w_down: Array,
  capacity_factor: float,
  axis: str | None = None,
) -> tuple[Array, Array]:
  """(output [tokens, D], fraction of assignments dropped): each expert computes at most slots = ceil(capacity_factor
  · assignments / E) of this device's assignments, the earliest tokens first (GShard's expert capacity per group), in
  one batched einsum per expert; a dropped assignment adds nothing (its token keeps the residual only, as in Switch
  and GShard).

  With `axis` (inside shard_map, the experts split over that mesh axis, E / devices local): the buffer [E, slots, D]
  is in global expert order, so one all_to_all hands each device its experts' slots from every device
  ([devices·slots] rows per local expert), and a second brings the outputs back. No device sends more than its own
  slots per expert."""
  num_tokens, top_k = choice_experts.shape
  local_experts, dim = w_gate.shape[0], x.shape[-1]
  devices = 1 if axis is None else jax.lax.axis_size(axis)
  num_experts = local_experts * devices
  slots = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
  row_experts = choice_experts.reshape(-1)
  rank = rank_in_group(row_experts, num_experts)
  kept = rank < slots
  row_slot = jnp.where(kept, row_experts * slots + rank, num_experts * slots)  # past the buffer: dropped
  # [E·slots, D]: expert e's slots are rows e·slots onwards.
  x_slots = jnp.zeros((num_experts * slots, dim), x.dtype).at[row_slot].set(jnp.repeat(x, top_k, axis=0), mode="drop")
  x_by_device = x_slots.reshape(devices, local_experts, slots, dim)  # destination device, its local expert, slot
  if axis is not None:
    x_by_device = jax.lax.all_to_all(x_by_device, axis, 0, 0, tiled=True)  # now: source device, local expert, slot
  x_local = x_by_device.swapaxes(0, 1).reshape(local_experts, devices * slots, dim)
  # u: rows per local expert (devices·slots); i, o: the product's input and output dims (D or F).
  out_local = swiglu_experts(
    x_local, w_gate, w_up, w_down, lambda x, w: jnp.einsum("Eui,Eio->Euo", x, w.astype(x.dtype))
  )
  out_by_device = out_local.reshape(local_experts, devices, slots, dim).swapaxes(0, 1)
  if axis is not None:
    out_by_device = jax.lax.all_to_all(out_by_device, axis, 0, 0, tiled=True)  # back in this device's [E, slots] order
  out_rows = jnp.take(out_by_device.reshape(num_experts * slots, dim), row_slot, axis=0, mode="fill", fill_value=0)
  return combine(out_rows, choice_weights * kept.reshape(num_tokens, top_k)), jnp.mean(1.0 - kept.astype(jnp.float32))


def dense(x: Array, choice_weights: Array, choice_experts: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
  """The reference: every expert on every token, summed with the routing weights (zero for unchosen experts)."""
  num_experts = w_gate.shape[0]
  # m: tokens, j: top-k choices.
  expert_weights = jnp.einsum(
    "mj,mjE->mE", choice_weights, jax.nn.one_hot(choice_experts, num_experts, dtype=choice_weights.dtype)
  )
  out_experts = swiglu_experts(x, w_gate, w_up, w_down, lambda x, w: _dense_product(x, w.astype(x.dtype)))
  return jnp.einsum("mED,mE->mD", out_experts, expert_weights.astype(out_experts.dtype))


def _dense_product(x: Array, w: Array) -> Array:
  # The first product reads tokens [tokens, D]; the second, each expert's own hidden rows [tokens, E, F].
  # m: tokens; i, o: the weight's input and output dims (D or F), w [E, in, out].
  return jnp.einsum("mi,Eio->mEo", x, w) if x.ndim == 2 else jnp.einsum("mEi,Eio->mEo", x, w)
