"""Interleaved prefill of long prompts: a prompt longer than `chunk` tokens is prefilled `chunk` tokens per
scheduler round into a cache of its own, while the engine runs a decode call for the running slots between rounds;
the last chunk writes it into its slot (``slots.insert_prefilled``) and the request starts. A running stream then
waits one chunk's prefill per round instead of the whole prompt's (vLLM's and SGLang's chunked prefill; engine.py
schedules it, slots.py holds the compiled chunk).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.inference.requests import Request
from llama_jax.inference.sampler import Sampler, bucket_length
from llama_jax.inference.slots import SlotState, insert_prefilled, prefill_chunk
from llama_jax.model import sharding
from llama_jax.model.llama import KVCache


@dataclasses.dataclass
class Staged:
  """A long prompt being prefilled: its request, the slot held for it, its cache (the prompt's bucket long), the
  logits of its last token once that chunk has run, the prompt right-padded to whole chunks, the next column."""

  request: Request
  slot: int
  cache: KVCache
  last: jax.Array
  prompt: np.ndarray
  start: int = 0

  @property
  def done(self) -> bool:
    return self.start >= len(self.request.prompt)


class ChunkedPrefill:
  """The compiled programs and bookkeeping of interleaved prefill for one engine (`chunk` 0: never applies)."""

  def __init__(self, sampler: Sampler, chunk: int, max_len: int, state_shardings: SlotState, replicated):
    self.sampler, self.chunk, self.max_len = sampler, chunk, max_len
    self._state_shardings, self._replicated = state_shardings, replicated

  def applies(self, request: Request) -> bool:
    """Whether `request` is prefilled by chunks: a chunk is set, the prompt is longer than it and its chunks fit its
    bucket, and it does not score its prompt (that needs every position's logits from one call)."""
    n, chunk = len(request.prompt), self.chunk
    return (
      bool(chunk)
      and n > chunk
      and not request.prompt_logprobs
      and -(-n // chunk) * chunk <= bucket_length(n, self.max_len)
    )

  def stage(self, request: Request, slot: int) -> Staged:
    n, chunk = len(request.prompt), self.chunk
    prompt = np.full((1, -(-n // chunk) * chunk), self.sampler.pad_id, np.int32)
    prompt[0, :n] = request.prompt
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      cache = KVCache.empty(self.sampler.cfg, 1, bucket_length(n, self.max_len), per_layer=True)
      last = jnp.zeros((1, 1, self.sampler.cfg.vocab_size), jnp.float32)
    return Staged(request, slot, cache, last, prompt)

  def run_chunk(self, staged: Staged) -> float:
    """Prefills the next chunk (waiting for it: the seconds are the device's) and returns the seconds."""
    put = functools.partial(jax.device_put, device=self._replicated)
    start = time.perf_counter()
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      staged.cache, staged.last = self._chunk_program(
        self.sampler.params,
        staged.cache,
        staged.last,
        put(staged.prompt[:, staged.start : staged.start + self.chunk]),
        put(np.int32(staged.start)),
        put(np.asarray([len(staged.request.prompt)], np.int32)),
      )
      jax.block_until_ready(staged.last)
    staged.start += self.chunk
    return time.perf_counter() - start

  def insert(self, state: SlotState, staged: Staged) -> tuple[SlotState, dict]:
    """The prefilled prompt written into its slot and the slot started; (state, its first token's outputs on the
    host). A slot past the last is written nowhere (warm-up)."""
    r = staged.request
    settings = (
      np.asarray([r.temperature], np.float32),
      np.asarray([r.top_k], np.int32),
      np.asarray([r.top_p], np.float32),
      np.asarray([r.seed], np.uint32),
      np.asarray([r.max_tokens], np.int32),
      np.asarray([r.logprobs], bool),
    )
    put = functools.partial(jax.device_put, device=self._replicated)
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      state, out = self._insert_program(
        state,
        staged.cache,
        staged.last,
        put(np.asarray([len(r.prompt)], np.int32)),
        put(np.asarray([staged.slot], np.int32)),
        tuple(put(v) for v in settings),
      )
    return state, jax.device_get(out)

  @functools.cached_property
  def _chunk_program(self):  # jit keys each bucket's cache shape itself
    return jax.jit(functools.partial(prefill_chunk, graphdef=self.sampler.graphdef), donate_argnums=(1, 2))

  @functools.cached_property
  def _insert_program(self):
    return jax.jit(
      functools.partial(insert_prefilled, stop_ids=self.sampler.stop_ids),
      out_shardings=(self._state_shardings, self._replicated),
      donate_argnums=(0,),  # the staging cache is read into the slot's row, not updated: nothing to reuse it for
    )
