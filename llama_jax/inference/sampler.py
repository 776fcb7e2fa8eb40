"""Decoding: a jitted prefill that fills an explicit KV cache, then one jitted while_loop that emits tokens.

On a mesh (``placement``), weights are split over `tensor` and batch rows over `data`; the batch is padded to a
multiple of `data` with copies of the first prompt, whose outputs are dropped.

Batched prompts are right-padded to a bucket length (powers of two from 16, so a new prompt length rarely
recompiles); padding is stored in the cache as empty slots, and each row continues from its own length with its own
positions. Generated tokens of every row go to the same slot (bucket + step), so the cache index stays one scalar.
Rows stop at eos or an extra stop id; finished rows keep emitting eos and no longer change. The cache holds
bucket + max_new_tokens slots; a prompt plus max_new_tokens beyond the model's max_seq_len is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.model_config import ModelConfig
from llama_jax.data.tokenization import Tokenizer
from llama_jax.inference import placement
from llama_jax.inference.sampling import SampleError, SamplingConfig, next_token
from llama_jax.model import sharding
from llama_jax.model.llama import KVCache, Llama

MIN_BUCKET = 16
GREEDY = SamplingConfig()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  """What the decode loop carries: the cache, each row's last token, next position and done flag, the RNG, the
  number of steps taken, and the tokens emitted so far [B, max_new_tokens]."""

  cache: KVCache
  token: jax.Array
  position: jax.Array
  done: jax.Array
  rng: jax.Array
  step: jax.Array
  tokens: jax.Array


def prefill(
  params: Any,
  prompts_BT: jax.Array,
  lengths_B: jax.Array,
  cache: KVCache,
  seed: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  sampling: SamplingConfig,
  max_new_tokens: int,
  stop_ids: tuple[int, ...],
  chunk: int = 0,
) -> DecodeState:
  """Runs the right-padded prompts through the model into the cache and samples each row's first new token. With
  `chunk` > 0, the prompts go in `chunk` tokens at a time (``prefill_chunks``)."""
  model = nnx.merge(graphdef, params)
  batch, bucket = prompts_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
  segment_ids_BT = (positions_BT < lengths_B[:, None]).astype(jnp.int32)
  if chunk and chunk < bucket:
    last_B1V, cache = prefill_chunks(model, prompts_BT, positions_BT, segment_ids_BT, lengths_B, cache, chunk)
  else:
    last_B1V, cache = model.decode(prompts_BT, positions_BT, cache, segment_ids_BT, logits_at_B=lengths_B - 1)
  last_BV = last_B1V[:, 0]
  rng, step_rng = jax.random.split(jax.random.key(seed))
  token_B = next_token(last_BV, step_rng, sampling)
  tokens = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token_B)
  return _constrained(
    DecodeState(
      cache=cache,
      token=token_B,
      position=lengths_B.astype(jnp.int32),
      done=jnp.isin(token_B, jnp.asarray(stop_ids)),
      rng=rng,
      step=jnp.ones((), jnp.int32),
      tokens=tokens,
    )
  )


def prefill_chunks(
  model: Llama,
  prompts_BT: jax.Array,
  positions_BT: jax.Array,
  segment_ids_BT: jax.Array,
  lengths_B: jax.Array,
  cache: KVCache,
  chunk: int,
) -> tuple[jax.Array, KVCache]:
  """(logits of each row's last prompt token [B, 1, V], cache): the prompts written into the cache `chunk` tokens
  at a time, each chunk attending to the cache so far (the slots after it are still empty, hidden by position), so
  the attention scores of a call are [chunk × cache] instead of [prompt × cache]. The full chunks run in one scan
  (one compiled body); a shorter last chunk, when the bucket is not a multiple of `chunk`, runs after it."""
  batch, bucket = prompts_BT.shape
  run = functools.partial(prefill_chunk_step, model, last_row_B=lengths_B - 1)

  def chunks(x_BT: jax.Array, n: int) -> jax.Array:  # [B, n·chunk] → [n, B, chunk]
    return x_BT[:, : n * chunk].reshape(batch, n, chunk).swapaxes(0, 1)

  n_full = bucket // chunk
  carry = (jnp.zeros((batch, 1, model.cfg.vocab_size), jnp.float32), cache)
  carry, _ = jax.lax.scan(
    lambda c, xs: (run(c, *xs), None),
    carry,
    (
      jnp.arange(n_full, dtype=jnp.int32) * chunk,
      chunks(prompts_BT, n_full),
      chunks(positions_BT, n_full),
      chunks(segment_ids_BT, n_full),
    ),
  )
  if bucket % chunk:
    tail = slice(n_full * chunk, bucket)
    carry = run(carry, n_full * chunk, prompts_BT[:, tail], positions_BT[:, tail], segment_ids_BT[:, tail])
  return carry


def prefill_chunk_step(
  model: Llama,
  carry: tuple[jax.Array, KVCache],
  start,
  tokens_BT: jax.Array,
  positions_BT: jax.Array,
  segments_BT: jax.Array,
  *,
  last_row_B: jax.Array,
) -> tuple[jax.Array, KVCache]:
  """One chunk of a chunked prefill: its T prompt columns from `start` written into the cache (attending to it), and
  the carried logits [B, 1, V] replaced in the rows whose last prompt token (`last_row_B`) lies in this chunk. The
  sampler's scan and the engine's interleaved prefill (one chunk per scheduler round) both run it."""
  last_B1V, cache = carry
  width = tokens_BT.shape[1]
  logits_B1V, cache = model.decode(
    tokens_BT, positions_BT, cache, segments_BT, logits_at_B=jnp.clip(last_row_B - start, 0, width - 1)
  )
  here_B = (last_row_B >= start) & (last_row_B < start + width)
  return jnp.where(here_B[:, None, None], logits_B1V, last_B1V), cache


def decode(
  params: Any,
  state: DecodeState,
  until_step: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  sampling: SamplingConfig,
  stop_ids: tuple[int, ...],
  pad_id: int,
) -> DecodeState:
  """Emits tokens until `until_step` tokens exist or every row is done: one compiled while_loop, no Python per
  token. Called once with until_step = max_new_tokens for a batch, or in chunks to stream."""
  model = nnx.merge(graphdef, params)
  stop = jnp.asarray(stop_ids)
  limit = jnp.minimum(until_step, state.tokens.shape[1])

  def cond(s: DecodeState):
    return (s.step < limit) & ~jnp.all(s.done)

  def body(s: DecodeState) -> DecodeState:
    logits_B1V, cache = model.decode(s.token[:, None], s.position[:, None], s.cache)
    rng, step_rng = jax.random.split(s.rng)
    token_B = next_token(logits_B1V[:, 0], step_rng, sampling)
    token_B = jnp.where(s.done, pad_id, token_B)  # finished rows no longer change
    tokens = jax.lax.dynamic_update_slice(s.tokens, token_B[:, None], (0, s.step))
    return _constrained(
      DecodeState(
        cache=cache,
        token=token_B,
        position=s.position + 1,
        done=s.done | jnp.isin(token_B, stop),
        rng=rng,
        step=s.step + 1,
        tokens=tokens,
      )
    )

  return jax.lax.while_loop(cond, body, state)


def _constrained(state: DecodeState) -> DecodeState:
  """The decode state in its shardings (under a mesh and rules; a no-op otherwise): the cache split by batch row
  and kv head, everything else (a few ints per row) replicated, so any process can read the emitted tokens and the
  loop condition needs no gather."""
  kv = [sharding.constrain(a, placement.CACHE_KV_AXES) for a in (*state.cache.k, *state.cache.v)]
  n = len(state.cache.k)
  cache = KVCache(
    k=tuple(kv[:n]),
    v=tuple(kv[n:]),
    positions=sharding.constrain(state.cache.positions, placement.CACHE_POSITIONS_AXES),
    index=state.cache.index,
  )
  small = {
    name: sharding.constrain(getattr(state, name), (None,) * getattr(state, name).ndim)
    for name in ("token", "position", "done", "tokens")
  }
  return DecodeState(cache=cache, rng=state.rng, step=state.step, **small)


# Physical order of each [B, K, S, H] cache buffer, major to minor, where the default row-major order costs memory.
# The TPU compiler keeps the cache slot-major inside the decode loop ([S, K, B, H]: what Layout.AUTO picks on v5p);
# handed a row-major buffer it copies the whole cache into that order at loop entry and back at exit (BENCHMARKS.md,
# "Figures behind the code"). Only for H a multiple of 128 (every LLaMA 2 size): TPU tiles the minor axis by 128, so
# a slot-major cache with a smaller H is padded to 128. Elsewhere row-major, which XLA:CPU's attention products read
# without a transpose.
SLOT_MAJOR = (2, 1, 0, 3)


def default_cache_layout(platform: str, head_dim: int) -> tuple[int, ...] | None:
  return SLOT_MAJOR if platform == "tpu" and head_dim % 128 == 0 else None


def cache_formats(mesh: Mesh, rules, n_layers: int, layout: tuple[int, ...] | None) -> KVCache:
  """Shardings (with the buffers' memory layout, where one is set) of a per-layer KV cache: a KVCache of them."""
  shardings = placement.cache_shardings(mesh, rules)
  kv = shardings["kv"] if layout is None else Format(Layout(major_to_minor=layout), shardings["kv"])
  per_layer = (kv,) * n_layers
  return KVCache(k=per_layer, v=per_layer, positions=shardings["positions"], index=shardings["index"])


def decode_programs(
  graphdef: nnx.GraphDef,
  mesh: Mesh,
  rules,
  param_shardings: Any,
  n_layers: int,
  *,
  layout: tuple[int, ...] | None,
  sampling: SamplingConfig,
  max_new_tokens: int,
  stop_ids: tuple[int, ...],
  pad_id: int,
  prefill_chunk: int = 0,
):
  """(prefill, decode loop) jitted with every input and output placement spelled out, so the cache keeps one layout
  from the empty buffers through prefill and every loop call (the Sampler runs these; ``plan --decode`` compiles
  them)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  rows = sharding.logical_to_spec(("activation_batch",), rules)
  state = DecodeState(
    cache=cache_formats(mesh, rules, n_layers, layout),
    token=replicated,
    position=replicated,
    done=replicated,
    rng=replicated,
    step=replicated,
    tokens=replicated,
  )
  prefill_fn = jax.jit(
    functools.partial(
      prefill,
      graphdef=graphdef,
      sampling=sampling,
      max_new_tokens=max_new_tokens,
      stop_ids=stop_ids,
      chunk=prefill_chunk,
    ),
    in_shardings=(
      param_shardings,
      NamedSharding(mesh, PartitionSpec(*rows, None)),
      NamedSharding(mesh, rows),
      state.cache,
      replicated,
    ),
    out_shardings=state,
    donate_argnums=(3,),
  )
  decode_fn = jax.jit(
    functools.partial(decode, graphdef=graphdef, sampling=sampling, stop_ids=stop_ids, pad_id=pad_id),
    in_shardings=(param_shardings, state, replicated),
    out_shardings=state,
    donate_argnums=(1,),
  )
  return prefill_fn, decode_fn


def bucket_length(n: int, limit: int) -> int:
  """The padded prompt length: the next power of two ≥ n (at least MIN_BUCKET), capped at `limit`."""
  bucket = MIN_BUCKET
  while bucket < n:
    bucket *= 2
  return max(n, min(bucket, limit))


class Sampler:
  """Compiled prefill and decode for one model on one mesh; programs are cached per (sampling, length, stops).

  `params` are the model's in either layout, anywhere (host numpy, one device, or already sharded); they are placed
  in the decoding layout with the decode shardings of `mesh` (see ``placement``), cast to `dtype` and quantized as
  asked. Batch rows are split over the mesh's `data` axis, weights over `tensor`. The Engine runs its continuous
  batching on a Sampler's placed model.

  Args:
    cfg: the model config the params are of.
    params: the model's params as a pure nested dict, stacked or unstacked.
    eos_id: the end-of-sequence token: a row stops there.
    pad_id: the token that pads prompts; None or negative: `eos_id`.
    stop_ids: the model's other stop tokens, e.g. a generation config's eos_token_id list.
    mesh: the decode mesh; None: one device.
    dtype: cast the weights and compute to this dtype; None: as stored.
    quantize: "int8": weight-only int8 with per-output-channel scales; "none": float.
    donate: free the given arrays as they are placed (loading from a checkpoint).
    cache_layout: the physical order of each KV cache buffer, major to minor; "auto": the platform's, slot-major on
      TPU where the head dim is a multiple of 128; None: row-major.
    prefill_chunk: prompts go into the cache this many tokens per model call, so prefill temporaries scale with the
      chunk, not the prompt; 0: the whole prompt in one call.

  Raises:
    SampleError: `prefill_chunk` is negative.
    InferenceError: the mesh, dtype or params do not fit the model.
  """

  def __init__(
    self,
    cfg: ModelConfig,
    params: Any,
    eos_id: int,
    pad_id: int | None = None,
    *,
    stop_ids: Sequence[int] = (),
    mesh: Mesh | None = None,
    dtype: str | None = None,
    quantize: str = "none",
    donate: bool = False,
    cache_layout: tuple[int, ...] | None | str = "auto",
    prefill_chunk: int = 0,
  ):
    self.mesh = mesh if mesh is not None else placement.decode_mesh(devices=jax.local_devices()[:1])
    if prefill_chunk < 0:
      raise SampleError(f"prefill_chunk must be ≥ 0 (0: the whole prompt in one call), got {prefill_chunk}")
    # Prompts go into the cache this many tokens per model call (0: all at once): prefill temporaries then scale
    # with the chunk, not the prompt.
    self.prefill_chunk = prefill_chunk
    # Decoding runs the layers as separate modules, each reading its own weight buffers in place.
    self.cfg, self.params = placement.place_params(
      cfg, params, self.mesh, dtype=dtype, quantize=quantize, donate=donate
    )
    self.rules = placement.decode_rules(self.cfg, self.mesh)
    self.eos_id = eos_id
    # Every token that ends a row: eos and the model's other stop tokens (a generation config's eos_token_id list).
    self.stop_ids = tuple(sorted({eos_id, *stop_ids}))
    self.pad_id = eos_id if pad_id is None or pad_id < 0 else pad_id
    self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(self.cfg, rngs=nnx.Rngs(0), stacked_layers=False)))
    # "auto": the platform's (default_cache_layout); None: row-major; or an explicit major-to-minor order (tests).
    platform = self.mesh.devices.flat[0].platform
    auto = default_cache_layout(platform, self.cfg.head_dim)
    self.cache_layout = auto if cache_layout == "auto" else cache_layout
    self._empty_cache = jax.jit(
      functools.partial(KVCache.empty, per_layer=True),
      static_argnums=(0, 1, 2),
      out_shardings=cache_formats(self.mesh, self.rules, self.cfg.n_layers, self.cache_layout),
    )

  def weight_bytes_per_device(self) -> int:
    """The most bytes of placed weights any one device of this process holds."""
    return placement.per_device_bytes(self.params)

  def cache_bytes_per_device(self, batch: int, length: int) -> int:
    """Bytes of one device's share of the KV cache of a batch.

    Args:
      batch: the prompts, padded here to a multiple of the data axis.
      length: the cache's slots per row.

    Returns:
      The bytes of one device's share.
    """
    return placement.cache_bytes_per_device(self.cfg, self.mesh, placement.padded_rows(batch, self.mesh), length)

  # Cached per sampler (the cache holding `self` is intended: a sampler lives as long as its compiled programs).
  @functools.lru_cache(maxsize=32)  # noqa: B019
  def _compiled(self, sampling: SamplingConfig, max_new_tokens: int, stop_ids: tuple[int, ...]):
    return decode_programs(
      self.graphdef,
      self.mesh,
      self.rules,
      jax.tree.map(lambda a: a.sharding, self.params),
      self.cfg.n_layers,
      layout=self.cache_layout,
      sampling=sampling,
      max_new_tokens=max_new_tokens,
      stop_ids=stop_ids,
      pad_id=self.pad_id,
      prefill_chunk=self.prefill_chunk,
    )

  def empty_cache(self, batch: int, length: int) -> KVCache:
    """A KV cache created directly in its shards and memory layout; one program per shape, compiled once per sampler.

    Args:
      batch: the cache's rows.
      length: the slots of each row.

    Returns:
      The empty per-layer cache.
    """
    return self._empty_cache(self.cfg, batch, length)

  def _put(self, host: np.ndarray, spec: PartitionSpec) -> jax.Array:
    """A host array (the same on every process) as a global array split by `spec`."""
    target = NamedSharding(self.mesh, spec)
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    chunk: int = 0,
    on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
  ) -> list[list[int]]:
    """Generate each prompt's new tokens, cut at the first stop token (the sampler's or `stop_ids`; kept out).

    The prompts are right-padded to a power-of-two bucket and prefilled in one call, then the decode loop runs. With
    `chunk` > 0 the loop runs `chunk` tokens per call and `on_tokens(new_tokens [B, n], done [B])` sees them as they
    come (streaming); otherwise one call runs to the end. Programs are compiled once per `sampling`,
    `max_new_tokens` and stop tokens.

    Args:
      prompts: token ids of each prompt, at least one, none empty.
      max_new_tokens: at most this many new tokens per prompt, at least 1.
      sampling: the setting for every row; default greedy.
      seed: the seed of the draws.
      stop_ids: stop tokens for this call, besides the sampler's own.
      chunk: tokens per decode call when streaming; 0: one call.
      on_tokens: called after each call with the new tokens [B, n] and each row's done flag [B].

    Returns:
      Each prompt's new tokens, in the order of `prompts`.

    Raises:
      SampleError: as `validate` raises it.
    """
    self.validate(prompts, max_new_tokens)
    stops = tuple(sorted({*self.stop_ids, *stop_ids}))
    n_prompts = len(prompts)
    prompts = list(prompts) + [prompts[0]] * (placement.padded_rows(n_prompts, self.mesh) - n_prompts)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    bucket = bucket_length(int(lengths.max()), self.cfg.max_seq_len - max_new_tokens)
    padded = np.full((len(prompts), bucket), self.pad_id, np.int32)
    for row, prompt in enumerate(prompts):
      padded[row, : len(prompt)] = prompt
    prefill_fn, decode_fn = self._compiled(sampling, max_new_tokens, stops)
    rows = sharding.logical_to_spec(("activation_batch",), self.rules)
    with sharding.activate(self.mesh, self.rules):
      cache = self.empty_cache(len(prompts), bucket + max_new_tokens)
      state = prefill_fn(
        self.params,
        self._put(padded, PartitionSpec(*rows, None)),
        self._put(lengths, rows),
        cache,
        self._put(np.asarray(seed, np.uint32), PartitionSpec()),
      )
      emitted = 0
      while True:
        step = int(state.step)
        done = np.asarray(state.done)[:n_prompts]
        if on_tokens is not None and step > emitted:
          on_tokens(np.asarray(state.tokens[:n_prompts, emitted:step]), done)
        emitted = step
        if step >= max_new_tokens or bool(np.all(np.asarray(state.done))):
          break
        until = max_new_tokens if not chunk else min(step + chunk, max_new_tokens)
        state = decode_fn(self.params, state, self._put(np.asarray(until, np.int32), PartitionSpec()))
    tokens = np.asarray(state.tokens[:n_prompts, :emitted])
    return [_until_stop(row, stops) for row in tokens]

  def validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Check that `generate` can run these prompts.

    Args:
      prompts: token ids of each prompt.
      max_new_tokens: the new tokens asked for.

    Raises:
      SampleError: no prompt, an empty prompt, `max_new_tokens` below 1, or the longest prompt + `max_new_tokens`
        beyond the model's ``max_seq_len``.
    """
    if not prompts:
      raise SampleError("no prompt given: pass at least one non-empty prompt")
    for i, prompt in enumerate(prompts):
      if len(prompt) == 0:
        raise SampleError(f"prompt {i} is empty: prompts need at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise SampleError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > self.cfg.max_seq_len:
      raise SampleError(
        f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
        f"exceeds the model's max_seq_len {self.cfg.max_seq_len}; shorten the prompt or lower "
        f"--max_new_tokens to at most {self.cfg.max_seq_len - longest}"
      )


def _until_stop(tokens: np.ndarray, stops: tuple[int, ...]) -> list[int]:
  out = []
  for token in tokens.tolist():
    if token in stops:
      break
    out.append(token)
  return out


def load_sampler(
  checkpoint_dir: str,
  mesh: Mesh | None = None,
  dtype: str | None = None,
  quantize: str = "none",
  step: int | None = None,
  prefill_chunk: int = 0,
) -> tuple[Sampler, Tokenizer]:
  """A Sampler and the tokenizer of a checkpoint directory, from training or conversion.

  The weights are restored straight into their decode shardings on `mesh`, cast to `dtype` on the way in and
  quantized as asked. The sampler stops at the tokenizer's eos and its generation config's stop tokens.

  Args:
    checkpoint_dir: the checkpoint directory, local or remote.
    mesh: the decode mesh; None: one device.
    dtype: cast the weights and compute to this dtype; None: as stored.
    quantize: "int8": weight-only int8 with per-output-channel scales; "none": float.
    step: the checkpoint step to read; None: the latest complete one.
    prefill_chunk: tokens per prefill call, as `Sampler` takes it; 0: the whole prompt in one call.

  Returns:
    The sampler and the directory's tokenizer.

  Raises:
    CheckpointError: the directory does not exist, is not a llama_jax checkpoint, has no tokenizer or one of
      another model, or has no complete step, not `step`, or damaged files.
    InferenceError: the mesh, dtype or quantization does not fit the model.
  """
  checkpoint_params.read_model_config(checkpoint_dir)  # a missing or foreign directory is named before anything else
  tokenizer = checkpoint_params.load_tokenizer(checkpoint_dir, "sampling needs one")
  mesh = mesh if mesh is not None else placement.decode_mesh(devices=jax.local_devices()[:1])
  cfg, params = placement.load_decode_params(checkpoint_dir, mesh, dtype=dtype, quantize=quantize, step=step)
  stops = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, stop_ids=tokenizer.stop_ids)
  return Sampler(cfg, params, **stops, mesh=mesh, prefill_chunk=prefill_chunk), tokenizer


def describe_placement(sampler: Sampler) -> str:
  """One line: the decode mesh and the weight bytes each device holds."""
  mesh = sampler.mesh
  kind = sampler.cfg.param_dtype + (" + int8" if sampler.cfg.quantize == "int8" else "")
  return (
    f"decoding on mesh {dict(mesh.shape)} of {mesh.devices.size} {mesh.devices.flat[0].platform} device(s): "
    f"{sampler.weight_bytes_per_device() / 2**20:.1f} MiB of weights ({kind}) per device"
  )
