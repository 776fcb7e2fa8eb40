"""Sampling settings, their allowed values, and the one filter that every decoder applies: temperature, top-k, then
the top-p nucleus. The Sampler (one setting for the batch), the Engine (a setting per slot) and the server's request
parsing (serving/protocol.py, which reads the bounds from `LIMITS`) all go through this module.

All sampling math is float32. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llama_jax.core.errors import LlamaJaxError

SEED_LIMIT = 2**32  # seeds are uint32


class SampleError(LlamaJaxError, ValueError):
  """A sampling request is out of range; the message names the value and the allowed range."""


@dataclasses.dataclass(frozen=True)
class Limit:
  """The allowed values of a sampling setting: [low, high] (or (low, high] when `low_open`); high None: unbounded,
  "vocab": the vocabulary size."""

  low: float
  high: float | str | None
  low_open: bool = False
  integer: bool = False
  meaning: str = ""  # what the neutral value does, e.g. "0 = greedy"


LIMITS = {
  "temperature": Limit(0, None, meaning="0 = greedy"),
  "top_k": Limit(0, "vocab", integer=True, meaning="0 = off"),
  "top_p": Limit(0, 1, low_open=True),
  "seed": Limit(0, SEED_LIMIT - 1, integer=True),
}


def check_sampling(
  temperature: float,
  top_k: int,
  top_p: float,
  seed: int = 0,
  vocab_size: int | None = None,
  error: type[SampleError] = SampleError,
) -> None:
  """Raises `error` (with `param`, the setting at fault) unless every setting is within its `LIMITS`."""
  problem = None
  if not temperature >= 0:
    problem = "temperature", f"temperature must be ≥ 0 (0 = greedy), got {temperature}"
  elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0 or (vocab_size and top_k > vocab_size):
    allowed = f"in [0, {vocab_size}]" if vocab_size else "≥ 0"
    problem = "top_k", f"top_k must be an integer {allowed} (0 = off), got {top_k}"
  elif not 0 < top_p <= 1:
    problem = "top_p", f"top_p must be in (0, 1], got {top_p}"
  elif not 0 <= seed < SEED_LIMIT:
    problem = "seed", f"seed must be in [0, 2**32), got {seed}"
  if problem is not None:
    param, message = problem
    raise error(message, param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """One sampling setting for a whole batch, as the Sampler takes it; checked when it is made.

  Logits are scaled by the temperature, then cut to the top-k, then to the top-p nucleus, all in float32. Frozen and
  hashable: the Sampler compiles its programs once per setting.

  Attributes:
    temperature: 0 is greedy, the argmax; must be ≥ 0.
    top_k: keep the k most likely tokens; 0 switches the filter off.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]; 1.0 switches the
      filter off.

  Raises:
    SampleError: a setting is out of range; the message names the value and the allowed range.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    check_sampling(self.temperature, self.top_k, self.top_p)


def filter_rows(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Temperature-scaled logits with everything outside each row's top-k and then its top-p nucleus (the smallest
  prefix of the top-k, by probability, whose mass reaches top_p) set to -inf; top_k 0 and top_p 1 switch a row's
  filter off. The one filter of the package."""
  vocab = scaled_BV.shape[-1]
  sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
  rank_V = jnp.arange(vocab)
  in_top_k_BV = (top_k_B[:, None] == 0) | (rank_V[None] < top_k_B[:, None])
  sorted_BV = jnp.where(in_top_k_BV, sorted_BV, -jnp.inf)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p.
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = in_top_k_BV & ((mass_before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0))
  threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled_BV < threshold_B1, -jnp.inf, scaled_BV)


def filter_logits(logits_BV: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """`filter_rows` of float32 logits scaled by the temperature, with `sampling`'s settings for every row."""
  batch = logits_BV.shape[0]
  scaled_BV = logits_BV.astype(jnp.float32) / sampling.temperature
  if not sampling.top_k and sampling.top_p >= 1.0:
    return scaled_BV  # no filter: no sort over the vocabulary
  return filter_rows(scaled_BV, jnp.full((batch,), sampling.top_k), jnp.full((batch,), sampling.top_p))


def next_token(logits_BV: jax.Array, rng: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """One token per row with the batch's setting: argmax at temperature 0, else a draw from the filtered logits."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, filter_logits(logits_BV, sampling), axis=-1).astype(jnp.int32)


def sample_rows(logits_BV, temperature_B, top_k_B, top_p_B, seed_B, position_B) -> jax.Array:
  """One token per row, each with its own settings (the Engine's slots): argmax where temperature is 0, else a draw
  from the temperature-scaled distribution cut by `filter_rows`. The draw's key is (seed, position of the new
  token): a request's tokens do not depend on which slot it runs in or what runs beside it."""
  logits_BV = logits_BV.astype(jnp.float32)
  scaled_BV = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
  # The sort over the vocabulary runs only when some sampling row filters.
  needs_filter = jnp.any((temperature_B > 0) & ((top_k_B > 0) | (top_p_B < 1.0)))
  scaled_BV = jax.lax.cond(needs_filter, lambda x: filter_rows(x, top_k_B, top_p_B), lambda x: x, scaled_BV)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def draw(scaled_BV):
    keys_B = jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.key(seed), position))(seed_B, position_B)
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BV).astype(jnp.int32)
    return jnp.where(temperature_B > 0, drawn_B, greedy_B)

  # Random draws over the vocabulary cost more than the step's products at small sizes (stories15M, 16 slots: one
  # Gumbel sample per vocabulary entry per row); an all-greedy batch skips them.
  return jax.lax.cond(jnp.any(temperature_B > 0), draw, lambda _: greedy_B, scaled_BV)
