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
  """A request the engine cannot run (prompt and max_tokens beyond the slots' length, bad sampling values)."""


class EngineBusy(EngineError):
  """The queue of waiting requests is full."""


@dataclasses.dataclass
class Output:
  """What a request receives, in order: new tokens (with their log-probabilities and top alternatives when asked),
  then one last output with `finish_reason` ("stop": eos; "length": max_tokens; "cancelled")."""

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
  """One generation: prompt ids, at most `max_tokens` new ones (0: only score the prompt), sampling settings
  (temperature 0 is greedy), and `on_output`, called from the engine's thread with each Output."""

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
  """An `on_output` that keeps everything a request receives (tests, benches, callers that do not stream)."""

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
