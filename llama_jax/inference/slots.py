"""The compiled programs of continuous batching: a fixed number of decode slots share one KV cache, carried in a
``SlotState``; `insert_prompts` prefills waiting prompts into free slots, and `generate_steps` runs a short chunk of
decode steps for every running slot at once. The scheduler that calls them is engine.py's ``Engine``.

The cache is a ring of S columns: one scalar write index advances one column per step for every slot. Attention
masks by the position stored with each column, not by column order, so a slot's tokens may sit anywhere in its row;
an inserted prompt is rolled to end just before the write index, and the slot then writes one column per step until
it is done. A slot's request spans at most S columns, so prompt + max_tokens ≤ S (the engine's max_len).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from llama_jax.inference.sampler import prefill_chunk_step
from llama_jax.inference.sampling import sample_rows
from llama_jax.model.kv_cache import EMPTY_POSITION, KVCache

# Top log-probabilities kept per token (OpenAI's completions API allows logprobs ≤ 5).
TOP_LOGPROBS = 5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
  """Everything the decode steps carry, one row per slot: the shared cache, each slot's last token and its position,
  whether it is running, how many tokens it may still emit, its sampling settings and whether it wants
  log-probabilities."""

  cache: KVCache
  token: jax.Array
  position: jax.Array
  active: jax.Array
  remaining: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  logprobs: jax.Array


_ROW_FIELDS = [f for f in dataclasses.fields(SlotState) if f.name != "cache"]


def token_logprobs(logits_BV, token_B):
  """(log-probability of each row's token, top-k log-probabilities and their ids) under the model's distribution
  (temperature 1, no filter: what OpenAI's `logprobs` report)."""
  logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  chosen_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
  top_values, top_ids = jax.lax.top_k(logprobs_BV, TOP_LOGPROBS)  # [B, TOP_LOGPROBS]
  return chosen_B, top_values, top_ids


def insert_prompts(
  params,
  state: SlotState,
  prompts_BT,
  lengths_B,
  slots_B,
  settings,
  *,
  graphdef,
  cfg,
  score_prompt: bool,
  stop_ids: tuple[int, ...],
):
  """Prefills B prompts together (right-padded to one bucket), writes each one's keys and values over its slot's
  row (rolled to end just before the write index) and starts the slots with their first sampled tokens. A row whose
  slot is out of range (≥ the number of slots) pads the batch to its power of two and is written nowhere. `settings`
  = per-row (temperature, top_k, top_p, seed, max_tokens, logprobs). Returns the state and the first tokens'
  outputs (plus every prompt position's, when scoring). One compiled program: prefill, then `_start_slots`."""
  model = nnx.merge(graphdef, params)
  batch, bucket = prompts_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
  segment_ids_BT = (positions_BT < lengths_B[:, None]).astype(jnp.int32)
  prefill_cache = KVCache.empty(cfg, batch, bucket, per_layer=True)
  if not score_prompt:
    last_B1V, prefill_cache = model.decode(prompts_BT, positions_BT, prefill_cache, segment_ids_BT, lengths_B - 1)
    return _start_slots(state, prefill_cache, last_B1V[:, 0], lengths_B, slots_B, settings, stop_ids)
  # Every position's logits: position t scores prompt token t + 1.
  logits_BTV, prefill_cache = model.decode(prompts_BT, positions_BT, prefill_cache, segment_ids_BT)
  last_BV = jnp.take_along_axis(logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  state, outputs = _start_slots(state, prefill_cache, last_BV, lengths_B, slots_B, settings, stop_ids)
  vocab = logits_BTV.shape[-1]
  next_BT = jnp.roll(prompts_BT, -1, axis=1)
  chosen, top_values, top_ids = token_logprobs(logits_BTV.reshape(batch * bucket, vocab), next_BT.reshape(-1))
  outputs.update(
    prompt_logprob=chosen.reshape(batch, bucket),
    prompt_top_values=top_values.reshape(batch, bucket, TOP_LOGPROBS),
    prompt_top_ids=top_ids.reshape(batch, bucket, TOP_LOGPROBS),
  )
  return state, outputs


def prefill_chunk(params, cache: KVCache, last_B1V, tokens_BT, start, lengths_B, *, graphdef):
  """One chunk of an interleaved prefill: T prompt tokens from column `start` into a staging cache of the prompt's
  bucket (the engine runs decode steps for the running slots between chunks, so a long prompt does not stall them).
  Returns the cache and the carried logits of each row's last prompt token (set by the chunk that holds it)."""
  model = nnx.merge(graphdef, params)
  positions_BT = start + jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
  segments_BT = (positions_BT < lengths_B[:, None]).astype(jnp.int32)
  last_B1V, cache = prefill_chunk_step(
    model, (last_B1V, cache), start, tokens_BT, positions_BT, segments_BT, last_row_B=lengths_B - 1
  )
  return cache, last_B1V


def insert_prefilled(state: SlotState, prefill_cache: KVCache, last_B1V, lengths_B, slots_B, settings, *, stop_ids):
  """The end of an interleaved prefill: the staging cache written into the slots and the slots started, as
  `insert_prompts` does after its one-call prefill."""
  return _start_slots(state, prefill_cache, last_B1V[:, 0], lengths_B, slots_B, settings, stop_ids)


def _start_slots(state: SlotState, prefill_cache: KVCache, last_BV, lengths_B, slots_B, settings, stop_ids):
  """Samples each row's first token from its last prompt logits, writes the prefilled keys and values over its
  slot's row and sets the slot running; (state, the first tokens' outputs)."""
  temperature_B, top_k_B, top_p_B, seed_B, max_tokens_B, logprobs_B = settings
  batch, bucket = prefill_cache.positions.shape
  token_B = sample_rows(last_BV, temperature_B, top_k_B, top_p_B, seed_B, lengths_B)
  outputs = dict(zip(("logprob", "top_values", "top_ids"), token_logprobs(last_BV, token_B)), token=token_B)
  columns = state.cache.positions.shape[1]
  # Each prompt's columns end just before the write index: its slot's next step writes at the index. Columns past
  # the prompt (padding, or chunks never run) hold positions ≥ its length or none: hidden until a step overwrites them.
  start_B = (state.cache.index - lengths_B) % columns
  roll_rows = jax.vmap(lambda row, shift: jnp.roll(row, shift, axis=-2 if row.ndim > 1 else -1))

  def into_rows(prefilled_BKTH, cache_BKSH):
    # One layer: the prompts' keys or values [B, K, T, H] (T: their bucket) into the slots' cache [slots, K, S, H].
    n_kv_heads, head_dim = prefilled_BKTH.shape[1], prefilled_BKTH.shape[3]
    padded = jnp.zeros((batch, n_kv_heads, columns - bucket, head_dim), cache_BKSH.dtype)
    rolled = roll_rows(jnp.concatenate([prefilled_BKTH.astype(cache_BKSH.dtype), padded], axis=2), start_B)
    return cache_BKSH.at[slots_B].set(rolled, mode="drop")

  empty = jnp.full((batch, columns - bucket), EMPTY_POSITION, jnp.int32)
  row_positions = roll_rows(jnp.concatenate([prefill_cache.positions, empty], axis=1), start_B)
  cache = KVCache(
    k=tuple(into_rows(p, r) for p, r in zip(prefill_cache.k, state.cache.k)),
    v=tuple(into_rows(p, r) for p, r in zip(prefill_cache.v, state.cache.v)),
    positions=state.cache.positions.at[slots_B].set(row_positions, mode="drop"),
    index=state.cache.index,
  )
  running_B = (max_tokens_B > 1) & ~jnp.isin(token_B, jnp.asarray(stop_ids))
  put = lambda a, values: a.at[slots_B].set(values.astype(a.dtype), mode="drop")  # noqa: E731
  state = SlotState(
    cache=cache,
    token=put(state.token, token_B),
    position=put(state.position, lengths_B),
    active=put(state.active, running_B),
    remaining=put(state.remaining, max_tokens_B - 1),
    temperature=put(state.temperature, temperature_B),
    top_k=put(state.top_k, top_k_B),
    top_p=put(state.top_p, top_p_B),
    seed=put(state.seed, seed_B),
    logprobs=put(state.logprobs, logprobs_B),
  )
  return state, outputs


def _first_rows(tree, rows: int):
  """The first `rows` slots of a SlotState (the cache's write index is shared, not per row)."""
  cache = tree.cache
  cache = KVCache(
    k=tuple(a[:rows] for a in cache.k),
    v=tuple(a[:rows] for a in cache.v),
    positions=cache.positions[:rows],
    index=cache.index,
  )
  return SlotState(cache=cache, **{f.name: getattr(tree, f.name)[:rows] for f in _ROW_FIELDS})


def _set_rows(full, part, rows: int):
  """`full` with its first `rows` slots replaced by `part` (in place: the state is donated)."""
  put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=0)  # noqa: E731
  cache = KVCache(
    k=tuple(put(a, b) for a, b in zip(full.cache.k, part.cache.k)),
    v=tuple(put(a, b) for a, b in zip(full.cache.v, part.cache.v)),
    positions=put(full.cache.positions, part.cache.positions),
    index=part.cache.index,
  )
  return SlotState(cache=cache, **{f.name: put(getattr(full, f.name), getattr(part, f.name)) for f in _ROW_FIELDS})


def generate_steps(params, state: SlotState, busy_B, *, graphdef, steps: int, stop_ids: tuple[int, ...], rows: int):
  """Up to `steps` decode steps for every running slot (stops early when none runs) among the first `rows`: the
  scheduler fills the lowest free slot first, so under light load the busy slots are few and low, and a step over
  `rows` of them costs what a batch of `rows` costs, not one of every slot (stories15M, 16 slots, one client:
  see BENCHMARKS.md). Slots the host no longer holds (`busy_B` false: cancelled) stop first. Returns the state and
  per step [steps, rows]: tokens, whether the slot emitted one, their log-probabilities and top alternatives. One
  compiled while_loop and its body, kept together for the same reason as `insert_prompts`."""
  if rows < state.token.shape[0]:
    part, out = generate_steps(
      params, _first_rows(state, rows), busy_B[:rows], graphdef=graphdef, steps=steps, stop_ids=stop_ids, rows=rows
    )
    return _set_rows(state, part, rows), out
  model = nnx.merge(graphdef, params)
  batch = state.token.shape[0]
  columns = state.cache.positions.shape[1]
  state = dataclasses.replace(state, active=state.active & busy_B)
  out = dict(
    token=jnp.zeros((steps, batch), jnp.int32),
    emitted=jnp.zeros((steps, batch), bool),
    logprob=jnp.zeros((steps, batch), jnp.float32),
    top_values=jnp.zeros((steps, batch, TOP_LOGPROBS), jnp.float32),
    top_ids=jnp.zeros((steps, batch, TOP_LOGPROBS), jnp.int32),
  )

  def cond(carry):
    i, s, _ = carry
    return (i < steps) & jnp.any(s.active)

  def body(carry):
    i, s, out = carry
    logits_B1V, cache = model.decode(s.token[:, None], s.position[:, None], s.cache)
    logits_BV = logits_B1V[:, 0]
    position_B = s.position + 1
    token_B = sample_rows(logits_BV, s.temperature, s.top_k, s.top_p, s.seed, position_B)
    # log_softmax and top-k over the vocabulary only when some running slot reports log-probabilities.
    logprob_B, top_values, top_ids = jax.lax.cond(
      jnp.any(s.logprobs & s.active),
      token_logprobs,
      lambda *_: (jnp.zeros((batch,)), jnp.zeros((batch, TOP_LOGPROBS)), jnp.zeros((batch, TOP_LOGPROBS), jnp.int32)),
      logits_BV,
      token_B,
    )
    emitted_B = s.active
    token_B = jnp.where(emitted_B, token_B, 0)
    remaining_B = s.remaining - emitted_B.astype(jnp.int32)
    s = SlotState(
      cache=dataclasses.replace(cache, index=cache.index % columns),
      token=token_B,
      position=jnp.where(emitted_B, position_B, s.position),
      active=emitted_B & ~jnp.isin(token_B, jnp.asarray(stop_ids)) & (remaining_B > 0),
      remaining=remaining_B,
      temperature=s.temperature,
      top_k=s.top_k,
      top_p=s.top_p,
      seed=s.seed,
      logprobs=s.logprobs,
    )
    new = dict(token=token_B, emitted=emitted_B, logprob=logprob_B, top_values=top_values, top_ids=top_ids)
    out = {name: out[name].at[i].set(new[name]) for name in out}
    return i + 1, s, out

  _, state, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, out))
  return state, out
