"""Mixture of experts: routing, the three ways to run the experts, and the router statistics the losses need.

Array functions only; the module holding the weights is ``llama.MoE``. Axis legend (beside llama.py's): E experts,
M the tokens of a call flattened (B·T), J the top-k choices of a token, A = M·J assignments (token, choice) in
expert order, U slots per expert (the capacity path), Y rows of a tile (the tiled grouped matmul), Z tiles.

The experts run one of three ways (``MoEConfig.compute``), all equal up to float rounding (tests/model/test_moe.py):
- dropless: the A assignments sorted by expert and multiplied by grouped matmuls (group e = the rows routed to
  expert e), no token dropped. The grouped matmul is ``jax.lax.ragged_dot`` (TPU and GPU kernels) or, on CPU, a
  tiled product: each group padded to whole tiles of Y rows, one [Y, D]·[D, F] product per tile in a scan. XLA:CPU
  computes ragged_dot as every group on every row, as slow as all experts on every token (BENCHMARKS.md, "Figures
  behind the code").
- capacity: each expert takes at most U = capacity_factor · A / E of a device's A assignments (earlier tokens
  first), computed as one batched einsum over [E, U, D]; the rest are dropped (their weight is lost, the residual
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
# the assignments are few (a decode step's B·J rows would otherwise be padded to E whole tiles of 128).
MAX_TILE_ROWS = 128
MIN_TILE_ROWS = 8


def route(logits_ME: Array, cfg: MoEConfig) -> tuple[Array, Array, Array]:
  """(weights [M, J] float32, experts [M, J] int32, probabilities [M, E] float32): softmax over the experts in
  float32, the top_k kept (ties to the lower expert id, as torch.topk), renormalised to sum to 1 when
  `normalize_top_k` (Mixtral)."""
  probs_ME = jax.nn.softmax(logits_ME.astype(jnp.float32), axis=-1)
  weights_MJ, experts_MJ = jax.lax.top_k(probs_ME, cfg.top_k)
  if cfg.normalize_top_k:
    weights_MJ = weights_MJ / jnp.sum(weights_MJ, axis=-1, keepdims=True)
  return weights_MJ, experts_MJ.astype(jnp.int32), probs_ME


def router_sums(logits_ME: Array, probs_ME: Array, experts_MJ: Array, mask_M: Array | None) -> dict[str, Array]:
  """One layer's sums over its (unmasked) tokens: `routed` [E] assignments per expert, `probability` [E] router
  probability per expert, `tokens`, `z` Σ logsumexp(logits)². Sums, not means: `balance_losses` divides them per
  layer, or once over all layers as transformers' load_balancing_loss_func does."""
  num_experts = probs_ME.shape[-1]
  mask_M = jnp.ones(probs_ME.shape[:1], jnp.float32) if mask_M is None else mask_M.astype(jnp.float32)
  chosen_MJE = jax.nn.one_hot(experts_MJ, num_experts, dtype=jnp.float32)
  z_M = jax.nn.logsumexp(logits_ME.astype(jnp.float32), axis=-1)
  return dict(
    routed=jnp.einsum("mje,m->e", chosen_MJE, mask_M),
    probability=jnp.einsum("me,m->e", probs_ME, mask_M),
    tokens=jnp.sum(mask_M),
    z=jnp.sum(z_M * z_M * mask_M),
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


def swiglu_experts(x_AD: Array, w_gate: Array, w_up: Array, w_down: Array, matmul) -> Array:
  """down(silu(gate(x)) · up(x)) of each row by its expert's weights, `matmul(rows, weights [E, I, O])` doing the
  grouping (the three paths differ only there)."""
  hidden_AF = jax.nn.silu(matmul(x_AD, w_gate)) * matmul(x_AD, w_up)
  return matmul(hidden_AF, w_down)


def dropless(
  x_MD: Array, weights_MJ: Array, experts_MJ: Array, w_gate: Array, w_up: Array, w_down: Array, grouped: str
) -> Array:
  """Every assignment computed by its expert (grouped matmuls over the assignments sorted by expert) and the top-k
  outputs of each token summed with their weights. `grouped`: "ragged_dot" or "tiles" (module docstring)."""
  num_tokens, top_k = experts_MJ.shape
  x_AD = jnp.repeat(x_MD, top_k, axis=0)  # assignment a = token·J + choice
  out_AD = grouped_swiglu(x_AD, experts_MJ.reshape(-1), w_gate, w_up, w_down, grouped)
  return combine(out_AD, weights_MJ)


def combine(out_AD: Array, weights_MJ: Array) -> Array:
  """Each token's output: its J assignments' outputs (rows token·J + choice) summed with their routing weights."""
  num_tokens, top_k = weights_MJ.shape
  return jnp.einsum("mjd,mj->md", out_AD.reshape(num_tokens, top_k, -1), weights_MJ.astype(out_AD.dtype))


def grouped_swiglu(x_AD: Array, experts_A: Array, w_gate: Array, w_up: Array, w_down: Array, grouped: str) -> Array:
  """Row a through expert experts_A[a]'s SwiGLU, the rows sorted by expert and run as groups. An id of E (or more)
  marks a row no expert takes (an empty slot of the expert-parallel exchange): it is sorted last, outside every
  group, and its output is not defined (zeros or whatever the product leaves); the caller never reads it."""
  num_experts = w_gate.shape[0]
  order_A = jnp.argsort(experts_A, stable=True)
  sorted_experts_A = jnp.take(experts_A, order_A)
  sizes_E = jnp.bincount(experts_A, length=num_experts).astype(jnp.int32)  # ids ≥ E are not counted
  x_AD = jnp.take(x_AD, order_A, axis=0)
  if grouped == "ragged_dot":
    out_AD = swiglu_experts(x_AD, w_gate, w_up, w_down, lambda x, w: jax.lax.ragged_dot(x, w.astype(x.dtype), sizes_E))
  else:
    out_AD = _tiled_experts(x_AD, sizes_E, sorted_experts_A, w_gate, w_up, w_down)
  return jnp.zeros_like(out_AD).at[order_A].set(out_AD, unique_indices=True)


def rank_in_group(group_A: Array, groups: int) -> Array:
  """For each row, how many earlier rows are in its group (0 for a group's first): its slot in a buffer per group
  (an expert's capacity, a destination device's send buffer), earlier rows first."""
  member_AG = jax.nn.one_hot(group_A, groups, dtype=jnp.int32)
  return jnp.sum((jnp.cumsum(member_AG, axis=0) - 1) * member_AG, axis=-1)


def tile_rows(assignments: int, num_experts: int) -> int:
  """Rows per tile: the fair share of assignments per expert rounded up to a power of two, within
  [MIN_TILE_ROWS, MAX_TILE_ROWS]."""
  share = max(1, -(-assignments // num_experts))
  return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, 1 << (share - 1).bit_length()))


def _tiled_experts(x_AD: Array, sizes_E: Array, sorted_experts_A: Array, w_gate, w_up, w_down) -> Array:
  """The grouped SwiGLU by tiles: group e's rows placed from a tile boundary, so every tile holds one expert's rows
  (and padding); at most A/Y + E tiles, a static bound. A scan runs one tile at a time, reading only its expert's
  weights, so no copy of the weights per tile is ever formed. Rows of no expert (id ≥ E) are left out."""
  assignments, dim = x_AD.shape
  num_experts = sizes_E.shape[0]
  rows = tile_rows(assignments, num_experts)
  num_tiles = assignments // rows + num_experts
  padded_E = (sizes_E + rows - 1) // rows * rows
  tile_end_E = jnp.cumsum(padded_E)
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  # Row of each sorted assignment in the tiled buffer: its group's first tile row plus its rank in the group; past
  # the buffer (dropped on the way in, zeros on the way out) for a row of no expert.
  taken_A = sorted_experts_A < num_experts
  expert_A = jnp.minimum(sorted_experts_A, num_experts - 1)
  slot_A = (tile_end_E - padded_E)[expert_A] + jnp.arange(assignments) - group_start_E[expert_A]
  slot_A = jnp.where(taken_A, slot_A, num_tiles * rows)
  x_ZYD = jnp.zeros((num_tiles * rows, dim), x_AD.dtype).at[slot_A].set(x_AD, mode="drop")
  x_ZYD = x_ZYD.reshape(num_tiles, rows, dim)
  # Expert of each tile; tiles past the last group hold only padding and run expert E-1 on zeros.
  expert_Z = jnp.minimum(jnp.searchsorted(tile_end_E, jnp.arange(num_tiles) * rows, side="right"), num_experts - 1)

  def one_tile(_, tile):
    x_YD, expert = tile
    return None, swiglu_experts(x_YD, w_gate[expert], w_up[expert], w_down[expert], lambda x, w: x @ w.astype(x.dtype))

  _, out_ZYD = jax.lax.scan(one_tile, None, (x_ZYD, expert_Z))
  return jnp.take(out_ZYD.reshape(num_tiles * rows, -1), slot_A, axis=0, mode="fill", fill_value=0)


def expert_parallel(
  x_MD: Array,
  weights_MJ: Array,
  experts_MJ: Array,
  w_gate: Array,
  w_up: Array,
  w_down: Array,
  *,
  grouped: str,
  axis: str = "expert",
) -> Array:
  """The dropless output [M, D] with the experts sharded over mesh axis `axis` (size P, E/P experts per device):
  called per device (inside shard_map), on this device's tokens and its own experts.

  Each assignment goes to the device holding its expert: rows packed per destination into a send buffer [P, A, D]
  (a slot for every assignment of the device per destination, since all of them may go to one: nothing is dropped,
  and the buffer is P times the rows sent), one all_to_all there and one back; a device runs what it receives
  grouped by its local experts. (`capacity` with an axis sends at most its expert capacity instead.) The dense
  all_to_all with fixed slots runs everywhere; XLA:CPU has no ragged all-to-all ("UNIMPLEMENTED: HLO opcode
  ragged-all-to-all"), so the 8-device equality tests could not run one."""
  num_tokens, top_k = experts_MJ.shape
  slots = num_tokens * top_k
  local_experts = w_gate.shape[0]
  devices = jax.lax.axis_size(axis)
  experts_A = experts_MJ.reshape(-1)
  destination_A = experts_A // local_experts
  slot_A = destination_A * slots + rank_in_group(destination_A, devices)
  send_x = jnp.zeros((devices * slots, x_MD.shape[-1]), x_MD.dtype).at[slot_A].set(jnp.repeat(x_MD, top_k, axis=0))
  # An empty slot keeps the id of no local expert.
  send_expert = jnp.full((devices * slots,), local_experts, jnp.int32).at[slot_A].set(experts_A % local_experts)

  def exchange(rows):
    return jax.lax.all_to_all(rows.reshape(devices, slots, *rows.shape[1:]), axis, 0, 0, tiled=True).reshape(rows.shape)

  received_PA_D = grouped_swiglu(exchange(send_x), exchange(send_expert), w_gate, w_up, w_down, grouped)
  return combine(jnp.take(exchange(received_PA_D), slot_A, axis=0), weights_MJ)


EXPERT_AXIS = "expert"


def expert_devices() -> int:
  """Size of the active mesh's expert axis (1 with no mesh, or no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)


def _mesh_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_experts(
  x_MD: Array,
  weights_MJ: Array,
  experts_MJ: Array,
  experts: Sequence[Array],
  expert_axes: Sequence[Sequence[str | None]],
  *,
  grouped: str,
  capacity_factor: float | None,
) -> tuple[Array, Array]:
  """(output [M, D], fraction dropped) of the experts run on every device of the active mesh: `expert_parallel`
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

  def per_device(x_MD, weights_MJ, experts_MJ, *local):
    # Dims other than the expert axis split over a manual axis (fsdp's "embed") are gathered, as FSDP gathers a
    # layer's weights; its backward is the reduce-scatter of the gradients.
    whole = []
    for w, spec in zip(local, weight_specs):
      for dim, entry in list(enumerate(spec))[1:]:
        if entry:
          w = jax.lax.all_gather(w, entry, axis=dim, tiled=True)
      whole.append(w)
    if capacity_factor is None:
      y_MD, dropped = expert_parallel(x_MD, weights_MJ, experts_MJ, *whole, grouped=grouped), jnp.zeros(())
    else:
      y_MD, dropped = capacity(x_MD, weights_MJ, experts_MJ, *whole, capacity_factor, axis=EXPERT_AXIS)
    return y_MD, jax.lax.pmean(dropped, tuple(sorted(manual)))

  return jax.shard_map(
    per_device,
    mesh=jax.sharding.get_abstract_mesh(),
    in_specs=(rows, rows, rows, *weight_specs),
    out_specs=(rows, PartitionSpec()),
    axis_names=manual,
    check_vma=False,
  )(x_MD, weights_MJ, experts_MJ, *experts)


def capacity(
  x_MD: Array,
  weights_MJ: Array,
  experts_MJ: Array,
  w_gate: Array,
  w_up: Array,
  w_down: Array,
  capacity_factor: float,
  axis: str | None = None,
) -> tuple[Array, Array]:
  """(output [M, D], fraction of assignments dropped): each expert computes at most U = ceil(capacity_factor · A / E)
  of this device's A assignments, the earliest tokens first (GShard's expert capacity per group), in one batched
  einsum per expert; a dropped assignment adds nothing (its token keeps the residual only, as in Switch and GShard).

  With `axis` (inside shard_map, the experts split over that mesh axis, E/P local): the buffer [E, U, D] is in
  global expert order, so one all_to_all hands each device its experts' slots from every device ([P·U] rows per
  local expert), and a second brings the outputs back. No device sends more than its own U per expert."""
  num_tokens, top_k = experts_MJ.shape
  local_experts, dim = w_gate.shape[0], x_MD.shape[-1]
  devices = 1 if axis is None else jax.lax.axis_size(axis)
  num_experts = local_experts * devices
  slots = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
  experts_A = experts_MJ.reshape(-1)
  rank_A = rank_in_group(experts_A, num_experts)
  kept_A = rank_A < slots
  slot_A = jnp.where(kept_A, experts_A * slots + rank_A, num_experts * slots)  # past the buffer: dropped
  x_EUD = jnp.zeros((num_experts * slots, dim), x_MD.dtype).at[slot_A].set(jnp.repeat(x_MD, top_k, axis=0), mode="drop")
  x_PLUD = x_EUD.reshape(devices, local_experts, slots, dim)  # destination device, its local expert, slot
  if axis is not None:
    x_PLUD = jax.lax.all_to_all(x_PLUD, axis, 0, 0, tiled=True)  # now: source device, local expert, slot
  x_LUD = x_PLUD.swapaxes(0, 1).reshape(local_experts, devices * slots, dim)
  out_LUD = swiglu_experts(x_LUD, w_gate, w_up, w_down, lambda x, w: jnp.einsum("eui,eio->euo", x, w.astype(x.dtype)))
  out_PLUD = out_LUD.reshape(local_experts, devices, slots, dim).swapaxes(0, 1)
  if axis is not None:
    out_PLUD = jax.lax.all_to_all(out_PLUD, axis, 0, 0, tiled=True)  # back in this device's [E, U] order
  out_AD = jnp.take(out_PLUD.reshape(num_experts * slots, dim), slot_A, axis=0, mode="fill", fill_value=0)
  return combine(out_AD, weights_MJ * kept_A.reshape(num_tokens, top_k)), jnp.mean(1.0 - kept_A.astype(jnp.float32))


def dense(x_MD: Array, weights_MJ: Array, experts_MJ: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
  """The reference: every expert on every token, summed with the routing weights (zero for unchosen experts)."""
  num_experts = w_gate.shape[0]
  combine_ME = jnp.einsum("mj,mje->me", weights_MJ, jax.nn.one_hot(experts_MJ, num_experts, dtype=weights_MJ.dtype))
  out_MED = swiglu_experts(x_MD, w_gate, w_up, w_down, lambda x, w: _dense_product(x, w.astype(x.dtype)))
  return jnp.einsum("med,me->md", out_MED, combine_ME.astype(out_MED.dtype))


def _dense_product(x: Array, w_EIO: Array) -> Array:
  # The first product reads tokens [M, D]; the second, each expert's own hidden rows [M, E, F].
  return jnp.einsum("mi,eio->meo", x, w_EIO) if x.ndim == 2 else jnp.einsum("mei,eio->meo", x, w_EIO)
