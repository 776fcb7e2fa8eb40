"""What callers hand the engine and get back: a `Request` (prompt, sampling settings, an `on_output` callback), the
`Output`s it receives, the engine's errors, and `Collector`, an `on_output` that keeps everything (engine.py runs
them; serving/ turns them into HTTP).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence

from llama_jax.inference.sampling import SampleError


class EngineError(SampleError):
  """A request the engine cannot run, or an engine that cannot run requests.

  Raised for a prompt and max_tokens beyond the slots' length or bad sampling values, and for an engine's bad
  settings or a thread that died. The message names the value and the allowed range; `param` and `code` say which
  field is at fault and what kind of error it is, as the server reports them.
  """


class EngineBusy(EngineError):
  """The queue of waiting requests is full."""


@dataclasses.dataclass
class Output:
  """What a request receives through `Request.on_output`, in order.

  First new tokens, with their log-probabilities and top alternatives when asked, then one last output with
  `finish_reason`. A cancelled request receives no output once it is cancelled, no finish either.

  Attributes:
    tokens: the new token ids of this output; a stop token that ends the text is not among them.
    logprobs: each token's log-probability, when the request asked for logprobs.
    top_logprobs: each token's top alternatives as (token id, log-probability) pairs, when asked.
    finish_reason: None until the last output; then "stop": eos or another stop id, "length": max_tokens,
      "cancelled", or "error".
    error: with finish_reason "error": what failed in the engine.
    eos_id: with finish_reason "stop" and logprobs: the stop token that ended the text, eos or another of the
      model's stop ids.
    eos_logprob: that stop token's log-probability.
    eos_top_logprobs: that stop token's top alternatives.
    prompt_logprobs: only in the first output of a request with prompt_logprobs: for prompt tokens 1..P-1, their
      log-probability given the tokens before.
    prompt_top_logprobs: the top alternatives at each of those positions.
  """

  tokens: list[int]
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  finish_reason: str | None = None
  error: str | None = None  # with finish_reason "error": what failed in the engine
  # With finish_reason "stop" and logprobs: the stop token that ended the text (eos or another of the model's stop
  # ids), its log-probability and its alternatives.
  eos_id: int | None = None
  eos_logprob: float | None = None
  eos_top_logprobs: list[tuple[int, float]] | None = None
  # Only in the first output of a request with prompt_logprobs: for prompt tokens 1..P-1, their log-probability
  # given the tokens before, and the top alternatives at that position.
  prompt_logprobs: list[float] | None = None
  prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One generation for the engine to run: prompt ids, how many new tokens, sampling settings and a callback.

  Attributes:
    prompt: the prompt's token ids, at least one.
    max_tokens: at most this many new tokens; 0: only score the prompt.
    on_output: called from the engine's thread with each `Output`; a callback that raises cancels its request only.
    temperature: 0 is greedy.
    top_k: keep the k most likely tokens; 0: off.
    top_p: keep the smallest nucleus whose probability reaches top_p; 1: off.
    seed: the seed of the draws, in [0, 2**32); with the new token's position it keys each draw, so a request's
      tokens do not depend on which slot it runs in or what runs beside it.
    logprobs: return each new token's log-probability and top alternatives.
    prompt_logprobs: return the prompt tokens' log-probabilities in the first output.
    id: a number unique in the process, given when the request is made.
    cancelled: set by `Engine.cancel`, or when `on_output` raises.
    emitted: the new tokens handed out so far.
    finished: the engine is done with the request.
  """

  prompt: Sequence[int]
  max_tokens: int
  on_output: Callable[[Output], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  logprobs: bool = False
  prompt_logprobs: bool = False
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  cancelled: bool = False
  emitted: int = 0
  finished: bool = False


class Collector:
  """An `on_output` that keeps everything a request receives (tests, benches, callers that do not stream).

  Pass it as `Request.on_output`, then wait on `done` and read what it kept.

  Attributes:
    tokens: every new token, in order.
    logprobs: their log-probabilities, when the request asked for them.
    top_logprobs: their top alternatives, when asked.
    outputs: every `Output` received, as received.
    finish_reason: the last output's finish_reason, None until then.
    done: set when the last output arrives.
  """

  def __init__(self):
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.top_logprobs: list[list[tuple[int, float]]] = []
    self.outputs: list[Output] = []
    self.finish_reason: str | None = None
    self.done = threading.Event()

  def __call__(self, output: Output) -> None:
    self.outputs.append(output)
    self.tokens += output.tokens
    self.logprobs += output.logprobs or []
    self.top_logprobs += output.top_logprobs or []
    if output.finish_reason is not None:
      self.finish_reason = output.finish_reason
      self.done.set()
