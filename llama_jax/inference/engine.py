"""Continuous batching: a fixed number of decode slots share one KV cache; requests join and leave between steps.

JetStream's shape. Requests waiting for free slots are prefilled together (rows padded to a power of two, prompts
to the longest one's power-of-two bucket, within a token budget), their keys and values are inserted into the free
slots' rows of the shared cache, and from then on one compiled call runs a short chunk of decode steps for every slot
at once (slots.py holds those programs). Each slot samples with its own temperature, top-k, top-p and seed (arrays in
the state, so requests with different settings share one program). Between calls the host hands each request its
new tokens, frees the slots that finished (eos, length, or cancelled by the caller) and admits waiting requests.

``serving/`` is the HTTP face of this class; tests and benches drive it directly.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax.inference.prefill import ChunkedPrefill, Staged
from llama_jax.inference.requests import EngineBusy, EngineError, Output, Request
from llama_jax.inference.sampler import Sampler, bucket_length, cache_formats
from llama_jax.inference.sampling import check_sampling
from llama_jax.inference.slots import SlotState, generate_steps, insert_prompts
from llama_jax.model import sharding

# Decode steps per compiled call: the host hands out tokens, frees finished slots and admits waiting requests after
# each call. 8 rather than 4 gave more throughput and a lower time to first token at every load in bench/serve.py
# (fewer host round trips; a new request waits at most one call) (BENCHMARKS.md, "Figures behind the code").
STEPS_PER_CALL = 8
# Tokens (rows × prompt bucket) one admission call may prefill, by default: waiting requests are prefilled together
# (16 prompts of ≤ 64 tokens in one call on stories15M) rather than one call each.
PREFILL_TOKENS = 1024


class Engine:
  """Continuous batching over a Sampler's placed model: `slots` concurrent requests share one KV cache.

  `submit` queues a request from any thread; `start` runs the scheduler in a background thread, where a failure in a
  step ends the running requests with finish_reason "error" and the slots start again, or call `step` yourself.

  Args:
    sampler: the placed model, its mesh, stop ids and cache layout.
    slots: the concurrent requests; a multiple of the mesh's data axis, since rows are split over it.
    max_len: the tokens of a slot, prompt + new, in [2, ``max_seq_len``]; None: the model's ``max_seq_len``.
    steps_per_call: decode steps of one compiled call, between which the host hands out tokens and admits requests.
    max_queue: the requests that may wait for a slot; `submit` refuses more.
    max_prefill_tokens: rows × prompt bucket one admission call may prefill; None: max(`max_len`, PREFILL_TOKENS).
    prefill_chunk: 0: whole prompts; a power of two ≤ `max_len`: a longer prompt is prefilled by chunks, one per `step`.

  Raises:
    EngineError: `max_len`, `slots`, `steps_per_call` or `prefill_chunk` is out of range.
  """

  def __init__(
    self,
    sampler: Sampler,
    slots: int = 8,
    max_len: int | None = None,
    steps_per_call: int = STEPS_PER_CALL,
    max_queue: int = 1024,
    max_prefill_tokens: int | None = None,
    prefill_chunk: int = 0,
  ):
    self.sampler = sampler
    cfg = sampler.cfg
    self.max_len = max_len or cfg.max_seq_len
    if not 2 <= self.max_len <= cfg.max_seq_len:
      raise EngineError(f"max_len must be in [2, {cfg.max_seq_len}] (the model's max_seq_len), got {self.max_len}")
    data = sampler.mesh.shape["data"]
    if slots < 1 or slots % data:
      raise EngineError(f"slots must be a positive multiple of the mesh's data axis {data}, got {slots}")
    if steps_per_call < 1:
      raise EngineError(f"steps_per_call must be ≥ 1, got {steps_per_call}")
    self.slots, self.steps_per_call, self.max_queue = slots, steps_per_call, max_queue
    if prefill_chunk and (prefill_chunk < 0 or prefill_chunk & (prefill_chunk - 1) or prefill_chunk > self.max_len):
      raise EngineError(
        f"prefill_chunk must be 0 (whole prompts) or a power of two ≤ max_len {self.max_len}, got {prefill_chunk}"
      )
    self._staging: Staged | None = None  # the long prompt being prefilled by chunks (prefill.py)
    # Requests waiting together are prefilled in one call while rows × bucket stays within this many tokens (its
    # activations and attention scores are the prefill's memory); a prompt longer than it is prefilled alone.
    self.max_prefill_tokens = max_prefill_tokens or max(self.max_len, PREFILL_TOKENS)
    self.failure: str | None = None
    self.stop_ids = sampler.stop_ids  # eos and the generation config's end-of-turn tokens
    mesh, rules = sampler.mesh, sampler.rules
    replicated = NamedSharding(mesh, PartitionSpec())
    self._state_shardings = SlotState(
      cache=cache_formats(mesh, rules, cfg.n_layers, sampler.cache_layout),
      **{name: replicated for name in ("token", "position", "active", "remaining", "temperature", "top_k", "top_p")},
      seed=replicated,
      logprobs=replicated,
    )
    self._param_shardings = jax.tree.map(lambda a: a.sharding, sampler.params)
    self._replicated = replicated
    self._chunked = ChunkedPrefill(sampler, prefill_chunk, self.max_len, self._state_shardings, replicated)
    with sharding.activate(mesh, rules):
      self.state = self._empty_state()
    self._queue: collections.deque[Request] = collections.deque()
    self._slot_requests: list[Request | None] = [None] * slots
    self._admitting: list[Request] = []  # popped from the queue, being prefilled
    self._wake = threading.Condition()
    self._thread: threading.Thread | None = None
    self._stopping = False
    self.stats = collections.Counter()
    # Called from the engine's thread after each device call with ("prefill" | "decode", seconds, tokens computed):
    # the server's metrics. Both calls end in a device_get, so the seconds are the device's, not a dispatch's.
    self.step_observers: list[Callable[[str, float, int], None]] = []

  # ---- programs ----

  def _empty_state(self) -> SlotState:
    cache = self.sampler.empty_cache(self.slots, self.max_len)
    zeros = np.zeros(self.slots, np.int32)
    small = dict(
      token=zeros,
      position=zeros,
      active=np.zeros(self.slots, bool),
      remaining=zeros,
      temperature=np.zeros(self.slots, np.float32),
      top_k=zeros,
      top_p=np.ones(self.slots, np.float32),
      seed=np.zeros(self.slots, np.uint32),
      logprobs=np.zeros(self.slots, bool),
    )
    return SlotState(cache=cache, **{name: jax.device_put(value, self._replicated) for name, value in small.items()})

  @functools.lru_cache(maxsize=16)  # noqa: B019 (one engine, one set of programs)
  def _generate_program(self, rows: int):
    return jax.jit(
      functools.partial(
        generate_steps, graphdef=self.sampler.graphdef, steps=self.steps_per_call, stop_ids=self.stop_ids, rows=rows
      ),
      in_shardings=(self._param_shardings, self._state_shardings, self._replicated),
      out_shardings=(self._state_shardings, self._replicated),
      donate_argnums=(1,),
    )

  def _rows_to_run(self) -> int:
    """Slots a step runs: the busy ones lie below this power of two. All slots on a data-parallel mesh (rows are
    split over devices) and with a slot-major cache (TPU), where the first rows are not one contiguous block: the
    trimmed step copies the busy rows' cache out and back once per call, cheap next to the rows' compute on CPU but
    not worth strided copies of a large cache."""
    if self.sampler.mesh.shape["data"] > 1 or self.sampler.cache_layout is not None:
      return self.slots
    highest = max(slot for slot, r in enumerate(self._slot_requests) if r is not None)
    rows = 1
    while rows <= highest:
      rows *= 2
    return min(rows, self.slots)

  @functools.lru_cache(maxsize=2)  # noqa: B019 (one engine, one set of programs; jit keys each shape itself)
  def _insert_program(self, score_prompt: bool):
    settings = (self._replicated,) * 6
    return jax.jit(
      functools.partial(
        insert_prompts,
        graphdef=self.sampler.graphdef,
        cfg=self.sampler.cfg,
        score_prompt=score_prompt,
        stop_ids=self.stop_ids,
      ),
      in_shardings=(
        self._param_shardings,
        self._state_shardings,
        self._replicated,
        self._replicated,
        self._replicated,
        settings,
      ),
      out_shardings=(self._state_shardings, self._replicated),
      donate_argnums=(1,),
    )

  def warmup(self) -> float:
    """Compile every program a request can need (prefill-and-insert for each prompt bucket, the step for each
    number of rows) before the first request, so none compiles while clients wait; returns the seconds taken.

    Raises:
      EngineError: a request was submitted already.
    """
    if self.pending():
      raise EngineError("warmup() runs before the first request")
    start = time.perf_counter()
    bucket = 0
    while bucket < self.max_len:  # prompts filling each bucket, max_tokens 0: prefilled, inserted, never run
      bucket = bucket_length(bucket + 1, self.max_len)
      idle = Request([self.sampler.pad_id] * bucket, 0, lambda _: None)
      self._insert_batch([idle], [0], score_prompt=True)  # echo + logprobs (loglikelihood scoring): one at a time
      rows = 1
      while rows <= _power_of_two(self.slots) and (rows == 1 or rows * bucket <= self.max_prefill_tokens):
        self._insert_batch([idle] * rows, list(range(rows)), score_prompt=False)
        rows *= 2
      if self._chunked.applies(idle):  # a staged prefill of this bucket: one chunk, then its insertion (no slot)
        staged = self._chunked.stage(idle, self.slots)
        self._chunked.run_chunk(staged)
        self.state, _ = self._chunked.insert(self.state, staged)
    rows = 1
    while True:
      self._run_rows(min(rows, self.slots), np.zeros(self.slots, bool))
      if rows >= self.slots:
        break
      rows *= 2
    return time.perf_counter() - start

  # ---- requests ----

  def validate(self, request: Request) -> None:
    """Check that this engine can run `request`.

    Raises:
      EngineError: naming the value and its allowed range: the prompt, `max_tokens` or a sampling setting.
    """
    n = len(request.prompt)
    if n == 0:
      raise EngineError("the prompt is empty: it needs at least one token")
    vocab = self.sampler.cfg.vocab_size
    if min(request.prompt) < 0 or max(request.prompt) >= vocab:
      bad = next(t for t in request.prompt if not 0 <= t < vocab)
      raise EngineError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    if request.max_tokens < 0:
      raise EngineError(f"max_tokens must be ≥ 0, got {request.max_tokens}")
    if n + request.max_tokens > self.max_len:
      raise EngineError(
        f"prompt of {n} tokens + max_tokens {request.max_tokens} = {n + request.max_tokens} exceeds the context "
        f"length {self.max_len}; shorten the prompt or lower max_tokens to at most {max(self.max_len - n, 0)}",
        param="max_tokens",
        code="context_length_exceeded",
      )
    check_sampling(request.temperature, request.top_k, request.top_p, request.seed, vocab, error=EngineError)

  def submit(self, request: Request) -> Request:
    """Queue a request, validated first, from any thread; its outputs arrive through `request.on_output`.

    Args:
      request: the request to run.

    Returns:
      The same request.

    Raises:
      EngineError: the request fails `validate`, or the engine's thread has died.
      EngineBusy: `max_queue` requests already wait.
    """
    self.validate(request)
    with self._wake:  # `failure` is set under the same lock as the last drain of the queue: nothing joins it after
      if self.failure is not None:
        raise EngineError(f"the engine stopped after an error: {self.failure}", code="engine_error")
      if len(self._queue) >= self.max_queue:  # requests cancelled while waiting leave room first
        waiting = [r for r in self._queue if not r.cancelled]
        self._queue.clear()
        self._queue.extend(waiting)
      if len(self._queue) >= self.max_queue:
        raise EngineBusy(
          f"{len(self._queue)} requests are already waiting (the limit is {self.max_queue}); retry later",
          code="overloaded",
        )
      self._queue.append(request)
      self._wake.notify()
    return request

  def alive(self) -> bool:
    """False once the scheduler thread has died (started engines only)."""
    return self.failure is None and (self._thread is None or self._thread.is_alive())

  def cancel(self, request: Request) -> None:
    """Stop a request (client gone, stop string seen): it receives no output from now on (no finish either), and
    its slot is freed before the next step.

    Args:
      request: a request given to `submit`.
    """
    request.cancelled = True
    with self._wake:
      self._wake.notify()

  def busy_slots(self) -> int:
    return sum(r is not None for r in self._slot_requests)

  def queued(self) -> int:
    return len(self._queue)

  def pending(self) -> int:
    """Requests not finished: waiting, being admitted, or in a slot."""
    return self.queued() + len(self._admitting) + self.busy_slots() + (self._staging is not None)

  def _deliver(self, request: Request, output: Output) -> None:
    """Hands an output to its request (none once it is cancelled); a callback that fails cancels that request
    only."""
    if request.cancelled:
      return
    try:
      request.on_output(output)
    except Exception:  # noqa: BLE001 (the caller's callback; other requests must go on)
      request.cancelled = True
      self.stats["callback_errors"] += 1

  # ---- scheduling ----

  def step(self) -> bool:
    """One round: drop cancelled requests, admit waiting ones into free slots (a long prompt: one more chunk of its
    prefill), run one chunk of decode steps and hand out the tokens.

    Returns:
      False when there was nothing to do, True otherwise.
    """
    for slot, request in enumerate(self._slot_requests):
      if request is not None and request.cancelled:
        self._finish(slot, "cancelled")
    admitted = False
    while self._queue and self._free_slots():
      self._admitting = self._next_admissions()
      if not self._admitting:
        break  # the queue's head is a long prompt: staged below, one at a time
      try:
        self._admit(self._admitting)
      except Exception as error:  # noqa: BLE001 (these requests fail; the others, and the slots, go on)
        for request in self._admitting:
          slot = next((i for i, r in enumerate(self._slot_requests) if r is request), None)
          if slot is not None:
            self._slot_requests[slot] = None
          if not request.finished:
            self._fail(request, error)
      finally:
        admitted = True
        self._admitting = []
    admitted = self._advance_staging() or admitted
    if not any(r is not None for r in self._slot_requests):
      return admitted
    busy = np.asarray([r is not None for r in self._slot_requests])
    start = time.perf_counter()
    out = self._run_rows(self._rows_to_run(), busy)
    self._observe("decode", time.perf_counter() - start, int(out["emitted"].sum()))
    self.stats["steps"] += int(out["emitted"].any(axis=1).sum())
    for slot, request in enumerate(self._slot_requests):
      if request is None:
        continue
      emitted = out["emitted"][:, slot]
      tokens = out["token"][emitted, slot].tolist()
      self.stats["tokens"] += len(tokens)
      logprobs = top = None
      if request.logprobs:
        logprobs = out["logprob"][emitted, slot].tolist()
        top = _pairs(out["top_ids"][emitted, slot], out["top_values"][emitted, slot])
      self._hand_out(slot, request, tokens, logprobs, top)
    return True

  def _free_slots(self) -> list[int]:
    """Slots no request holds, less the one a staged prefill will start in."""
    held = self._staging.slot if self._staging is not None else None
    return [slot for slot, r in enumerate(self._slot_requests) if r is None and slot != held]

  # ---- interleaved (chunked) prefill of long prompts ----

  def _advance_staging(self) -> bool:
    """Starts staging the queue's head when it is a long prompt and a slot is free, and runs one chunk of the staged
    prefill; the last chunk starts the request in its slot. False when there is none."""
    # The admission loop before this left the queue's head a long prompt (cancelled heads dropped) or no free slot.
    if self._staging is None and self._queue and self._free_slots() and self._chunked.applies(self._queue[0]):
      self._staging = self._chunked.stage(self._queue.popleft(), self._free_slots()[0])
    staging = self._staging
    if staging is None:
      return False
    if staging.request.cancelled:
      self._staging = None
      staging.request.finished = True
      self.stats["finished_cancelled"] += 1
      return True
    try:
      tokens = min(self._chunked.chunk, len(staging.request.prompt) - staging.start)
      seconds = self._chunked.run_chunk(staging)
      self.stats["prefill_chunks"] += 1
      self._observe("prefill", seconds, tokens)
      if staging.done:
        self.state, out = self._chunked.insert(self.state, staging)
        self._start(staging.request, staging.slot, out, 0)
    except Exception as error:  # noqa: BLE001 (this request fails; the slots go on)
      self._slot_requests[staging.slot] = None
      if not staging.request.finished:
        self._fail(staging.request, error)
    finally:
      if self._staging is staging and (staging.request.finished or staging.done):
        self._staging = None
    return True

  def _run_rows(self, rows: int, busy: np.ndarray) -> dict:
    """One compiled chunk of decode steps over the first `rows` slots; its outputs on the host."""
    program = self._generate_program(rows)
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      self.state, out = program(self.sampler.params, self.state, jax.device_put(busy, self._replicated))
    return jax.device_get(out)

  def _observe(self, kind: str, seconds: float, tokens: int) -> None:
    for observer in self.step_observers:
      observer(kind, seconds, tokens)

  def _hand_out(self, slot: int, request: Request, tokens: list[int], logprobs, top) -> None:
    """A running request's new tokens: delivered, and the request finished at eos or at max_tokens. eos is not part
    of the tokens; its log-probability comes with the finishing output (loglikelihood clients count it)."""
    finish, eos = None, None
    if tokens and tokens[-1] in self.stop_ids:
      finish = "stop"
      if logprobs is not None:
        eos = (tokens[-1], logprobs[-1], top[-1])
        logprobs, top = logprobs[:-1], top[:-1]
      tokens = tokens[:-1]
    elif request.emitted + len(tokens) >= request.max_tokens:
      finish = "length"
    request.emitted += len(tokens)
    if tokens and not request.cancelled:
      self._deliver(request, Output(tokens, logprobs, top))
    if finish:
      self._finish(slot, finish, eos)

  def _next_admissions(self) -> list[Request]:
    """The waiting requests to prefill together, first come first: as many as there are free slots while rows
    (padded to a power of two) × bucket stays within max_prefill_tokens. A request scoring its prompt goes alone
    (its prefill returns every position's log-probabilities, not only the last one's)."""
    free = len(self._free_slots())
    batch, longest = [], 0
    while self._queue and len(batch) < free:
      request = self._queue[0]
      if request.cancelled:
        self._queue.popleft()
        continue
      if self._chunked.applies(request):
        break
      if batch and (request.prompt_logprobs or batch[0].prompt_logprobs):
        break
      n = max(longest, len(request.prompt))
      if batch and _power_of_two(len(batch) + 1) * bucket_length(n, self.max_len) > self.max_prefill_tokens:
        break
      batch.append(self._queue.popleft())
      longest = n
    return batch

  def _insert_batch(self, requests: Sequence[Request], slots: Sequence[int], score_prompt: bool) -> dict:
    """Prefills the requests' prompts into their slots in one call (rows padded to a power of two, prompts to
    their bucket); the first tokens' (and the prompts') outputs on the host, one row per request."""
    rows = _power_of_two(len(requests))
    lengths = [len(r.prompt) for r in requests]
    prompts = np.full((rows, bucket_length(max(lengths), self.max_len)), self.sampler.pad_id, np.int32)
    for row, request in enumerate(requests):
      prompts[row, : lengths[row]] = request.prompt
    pad = rows - len(requests)
    column = lambda values, dtype, fill: np.asarray(list(values) + [fill] * pad, dtype)  # noqa: E731
    settings = (
      column((r.temperature for r in requests), np.float32, 0),
      column((r.top_k for r in requests), np.int32, 0),
      column((r.top_p for r in requests), np.float32, 1),
      column((r.seed for r in requests), np.uint32, 0),
      column((r.max_tokens for r in requests), np.int32, 0),
      column((r.logprobs for r in requests), bool, False),
    )
    put = functools.partial(jax.device_put, device=self._replicated)
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      self.state, out = self._insert_program(score_prompt)(
        self.sampler.params,
        self.state,
        put(prompts),
        put(column(lengths, np.int32, 1)),
        put(column(slots, np.int32, self.slots)),  # padding rows: a slot past the last, written nowhere
        tuple(put(v) for v in settings),
      )
    return jax.device_get(out)

  def _admit(self, requests: Sequence[Request]) -> None:
    """Prefills the requests into free slots and hands out their first tokens (a max_tokens 0 request ends
    there, with its prompt's log-probabilities when asked)."""
    slots = self._free_slots()[: len(requests)]
    start = time.perf_counter()
    out = self._insert_batch(requests, slots, score_prompt=requests[0].prompt_logprobs)
    self._observe("prefill", time.perf_counter() - start, sum(len(r.prompt) for r in requests))
    self.stats["prefill_calls"] += 1
    for row, (request, slot) in enumerate(zip(requests, slots)):
      self._start(request, slot, out, row)

  def _start(self, request: Request, slot: int, out: dict, row: int) -> None:
    """A prefilled request (row `row` of a prefill's outputs `out`) starts in `slot`: its first token handed out, or
    with max_tokens 0 it ends there, with its prompt's log-probabilities when asked. Both prefill paths end here."""
    n = len(request.prompt)
    self.stats["requests"] += 1
    self.stats["prefill_tokens"] += n
    if request.prompt_logprobs:
      prompt_top = _pairs(out["prompt_top_ids"][row, : n - 1], out["prompt_top_values"][row, : n - 1])
      prompt_logprobs = out["prompt_logprob"][row, : n - 1].tolist()
      output = Output([], prompt_logprobs=prompt_logprobs, prompt_top_logprobs=prompt_top)
      if request.max_tokens == 0:
        output.finish_reason = "length"
      self._deliver(request, output)
    if request.max_tokens == 0:
      request.finished = True
      self.stats["finished_length"] += 1
      if not request.prompt_logprobs:
        self._deliver(request, Output([], finish_reason="length"))
      return
    self._slot_requests[slot] = request
    logprobs = top = None
    if request.logprobs:
      logprobs, top = (
        [float(out["logprob"][row])],
        _pairs(out["top_ids"][row : row + 1], out["top_values"][row : row + 1]),
      )
    self._hand_out(slot, request, [int(out["token"][row])], logprobs, top)

  def _finish(self, slot: int, reason: str, eos=None) -> None:
    request = self._slot_requests[slot]
    self._slot_requests[slot] = None
    self.stats["finished_" + reason] += 1
    request.finished = True
    if reason != "cancelled":
      output = Output([], finish_reason=reason)
      if eos is not None:
        output.eos_id, output.eos_logprob, output.eos_top_logprobs = eos
      self._deliver(request, output)

  # ---- background thread ----

  def start(self) -> Engine:
    """Runs the scheduler in a daemon thread until `stop`; returns this engine."""
    if self._thread is None:
      self._stopping = False
      self._thread = threading.Thread(target=self._run, name="llama_jax-engine", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    with self._wake:
      self._stopping = True
      self._wake.notify()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _run(self) -> None:
    while not self._stopping:
      with self._wake:
        while not self._stopping and not self._queue and not any(self._slot_requests):
          self._wake.wait(timeout=1.0)
      if self._stopping:
        break
      try:
        self.step()
      except Exception as error:  # noqa: BLE001 (every running request must hear of it, then the thread goes on)
        try:
          self._fail_all(error)
        except Exception as fatal:  # noqa: BLE001 (the slots cannot be rebuilt: fail what waits and stop)
          with self._wake:
            self.failure = f"{type(fatal).__name__}: {fatal}"
            waiting = list(self._queue)
            self._queue.clear()
          for request in waiting:
            self._fail(request, fatal)
          return

  def _fail(self, request: Request, error: Exception) -> None:
    self.stats["finished_error"] += 1
    request.finished = True
    self._deliver(request, Output([], finish_reason="error", error=f"{type(error).__name__}: {error}"))

  def _fail_all(self, error: Exception) -> None:
    """An unexpected failure inside a step ends every request in a slot with finish_reason "error" and the message,
    and starts again from empty slots (queued requests wait for them): the engine keeps serving."""
    running = [r for r in self._slot_requests if r is not None]
    if self._staging is not None:
      running.append(self._staging.request)
      self._staging = None
    self._slot_requests = [None] * self.slots
    for request in running:  # first: if the rebuild below fails too, these have heard already
      self._fail(request, error)
    self.state = None  # the old cache is freed before the new one is made
    with sharding.activate(self.sampler.mesh, self.sampler.rules):
      self.state = self._empty_state()

  def generate(self, requests: Sequence[Request], timeout: float = 600.0) -> None:
    """Runs the requests to the end on the calling thread (engine not started): tests and benches.

    Raises:
      EngineError: a request is refused by `submit`, or requests still run after `timeout`.
    """
    for request in requests:
      self.submit(request)
    deadline = time.monotonic() + timeout
    while self.pending():
      if time.monotonic() > deadline:
        raise EngineError(f"requests still running after {timeout} s")
      self.step()


def _power_of_two(n: int) -> int:
  return 1 << (n - 1).bit_length()


def _pairs(ids, values) -> list[list[tuple[int, float]]]:
  return [list(zip(row_ids.tolist(), row_values.tolist())) for row_ids, row_values in zip(ids, values)]
