"""The OpenAI API's request fields, checked one by one, and the text side of a response: incremental detokenizing,
stop strings, log-probabilities with text offsets.

Every bad value raises ``ApiError`` naming the field and the allowed range; ``app.py`` turns it into OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``) with its HTTP status. Fields OpenAI defines but
this server does not implement (penalties, logit_bias, suffix, n with best_of) are refused when set to anything but
their neutral value, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from llama_jax.data import chat_template
from llama_jax.data.jinja_chat import ChatTemplateError
from llama_jax.inference.sampling import LIMITS
from llama_jax.inference.slots import TOP_LOGPROBS

# OpenAI allows 4; lm-eval sends a task's whole `until` list plus eos to /v1/completions (6 for humaneval).
MAX_STOP_STRINGS = 16
MAX_CHOICES = 64  # prompts × n of one request: each is one engine request
# OpenAI's bounds where they are narrower or wider than the sampler's own (inference/sampling.py's LIMITS): the API
# takes temperatures up to 2, and top_k -1 for "off", as vLLM does.
MAX_TEMPERATURE = 2
TOP_K_OFF = -1


class ApiError(Exception):
  """A request the API refuses: HTTP status, message (naming the field and the allowed values), param, code."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
      self.status, "invalid_request_error" if self.status < 500 else "server_error"
    )
    return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_value(param: str, message: str) -> ApiError:
  return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _number(body: dict, name: str, default, *, integer: bool, low=None, high=None, low_open=False):
  """A numeric field (JSON null = the default) in [low, high] (or (low, high] with low_open)."""
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
    kind = "an integer" if integer else "a number"
    raise bad_value(name, f"must be {kind}, got {json_repr(value)}")
  if isinstance(value, float) and not math.isfinite(value):  # (an int of any size compares without overflow)
    raise bad_value(name, f"must be finite, got {value}")
  below = value <= low if low_open else value < low if low is not None else False
  if below or (high is not None and value > high):
    lo = "-inf" if low is None else low
    interval = f"{'(' if low_open else '['}{lo}, {high if high is not None else 'inf'}]"
    raise bad_value(name, f"must be in {interval}, got {value}")
  return value


def _bool(body: dict, name: str, default: bool) -> bool:
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise bad_value(name, f"must be true or false, got {json_repr(value)}")
  return value


def json_repr(value: Any) -> str:
  text = repr(value) if not isinstance(value, str) else f'"{value}"'
  return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass
class Sampling:
  """The sampling fields shared by both endpoints."""

  max_tokens: int | None
  temperature: float
  top_p: float
  top_k: int
  seed: int | None
  stop: list[str]
  stream: bool
  include_usage: bool
  n: int


# Fields of OpenAI's API this server does not implement, refused unless given their neutral value.
UNSUPPORTED = {
  "best_of": (1,),
  "tools": ([],),
  "functions": ([],),
  "tool_choice": ("none",),
  "response_format": ({"type": "text"},),
  "logit_bias": ({},),
}


def parse_sampling(body: dict, max_len: int, vocab_size: int, *, chat_api: bool) -> Sampling:
  for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
    if body.get(name) not in (None, neutral, 0.0):
      _number(body, name, 0, integer=False, low=-2, high=2)
      raise bad_value(name, f"is not supported by this server; only {neutral} is accepted")
  for name, neutral in UNSUPPORTED.items():
    if body.get(name) is not None and body[name] not in neutral:
      raise bad_value(name, "is not supported by this server")
  stop = body.get("stop")
  if stop is None:
    stop = []
  elif isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
    raise bad_value("stop", f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
  options = body.get("stream_options")
  if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
    raise bad_value("stream_options", 'must be an object like {"include_usage": true}')
  temperature, top_k, top_p, seed = (LIMITS[name] for name in ("temperature", "top_k", "top_p", "seed"))
  max_tokens = _number(body, "max_tokens", None, integer=True, low=0, high=max_len)
  if chat_api and body.get("max_completion_tokens") is not None:  # the newer name of max_tokens in chat
    max_tokens = _number(body, "max_completion_tokens", None, integer=True, low=0, high=max_len)
  return Sampling(
    max_tokens=max_tokens,
    temperature=float(_number(body, "temperature", 1.0, integer=False, low=temperature.low, high=MAX_TEMPERATURE)),
    top_p=float(_number(body, "top_p", 1.0, integer=False, low=top_p.low, high=top_p.high, low_open=top_p.low_open)),
    top_k=max(_number(body, "top_k", 0, integer=True, low=TOP_K_OFF, high=vocab_size), top_k.low),
    seed=_number(body, "seed", None, integer=True, low=seed.low, high=seed.high),
    stop=stop,
    stream=_bool(body, "stream", False),
    include_usage=bool(options and options.get("include_usage")),
    n=_number(body, "n", 1, integer=True, low=1, high=MAX_CHOICES),
  )


def parse_prompts(body: dict, tokenizer) -> list[list[int]]:
  """`prompt` as OpenAI takes it: a string, a list of strings, a list of token ids, or a list of such lists.
  Strings are encoded with bos, as the sample CLI does; token ids are taken as given."""
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
    prompts = [prompt]  # one prompt of token ids
  elif isinstance(prompt, list) and prompt:
    prompts = prompt
  else:
    raise bad_value("prompt", f"must be a string, a list of strings or a list of token ids, got {json_repr(prompt)}")
  encoded = []
  for i, item in enumerate(prompts):
    if isinstance(item, str):
      if not item:
        raise bad_value("prompt", f"prompt {i} is empty")
      encoded.append(encode(tokenizer, item, "prompt", bos=True))
    elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
      encoded.append(list(item))
    else:
      raise bad_value("prompt", f"item {i} must be a non-empty string or list of token ids, got {json_repr(item)}")
  for i, ids in enumerate(encoded):
    for token in ids:
      if not 0 <= token < tokenizer.vocab_size:
        raise bad_value("prompt", f"prompt {i} has token id {token} outside the vocabulary [0, {tokenizer.vocab_size})")
  if len(encoded) > MAX_CHOICES:
    raise bad_value("prompt", f"at most {MAX_CHOICES} prompts per request, got {len(encoded)}")
  return encoded


def encode(tokenizer, text: str, param: str, bos: bool = False) -> list[int]:
  """Token ids of request text; text the tokenizer cannot take (a lone UTF-16 surrogate) is a 400."""
  try:
    return tokenizer.encode(text, bos=bos)
  except (RuntimeError, UnicodeError) as error:
    raise bad_value(param, f"the text cannot be encoded: {error}") from None


def parse_messages(body: dict, tokenizer) -> list[int]:
  """`messages` in the checkpoint's chat template (LLaMA 2's when it has none, ``chat_template.py``): an optional system
  message, then user and assistant turns alternating, ending with a user turn. Content may be a string or a list of
  text parts. A conversation the template refuses, or a template that fails on it, is a 400 with the template's
  words."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad_value("messages", "must be a non-empty list of {role, content} objects")
  plain = []
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise bad_value("messages", f"message {i} must be an object with role and content")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise bad_value("messages", f"message {i}: only text content parts are supported")
      content = "".join(p["text"] for p in content)
    plain.append({"role": message.get("role"), "content": content})
  try:
    chat_template.check_conversation(plain, for_training=False)
  except chat_template.ConversationError as error:
    raise bad_value("messages", str(error)) from None
  for message in plain:
    encode(tokenizer, message["content"], "messages")  # text the tokenizer refuses is the client's error
  try:
    return chat_template.encode_dialog(tokenizer, plain).tokens
  except (chat_template.ConversationError, ChatTemplateError) as error:
    raise bad_value("messages", str(error)) from None


def parse_logprobs(body: dict, *, chat_api: bool) -> int | None:
  """How many top alternatives to report per token (None: no log-probabilities)."""
  if chat_api:
    if not _bool(body, "logprobs", False):
      if body.get("top_logprobs") is not None:
        raise bad_value("top_logprobs", "needs logprobs: true")
      return None
    return _number(body, "top_logprobs", 0, integer=True, low=0, high=TOP_LOGPROBS)
  return _number(body, "logprobs", None, integer=True, low=0, high=TOP_LOGPROBS)


class Detokenizer:
  """Text of a growing token sequence, a piece at a time. Each step decodes a short window (the last few tokens
  before the new ones, so a leading space and multi-byte characters split over byte pieces come out right) and
  holds text back while it ends in an unfinished character."""

  CONTEXT = 6

  def __init__(self, tokenizer, ids: Sequence[int] = ()):
    self.tokenizer = tokenizer
    self.ids = list(ids)
    self.prefix = max(len(self.ids) - self.CONTEXT, 0)
    self.read = len(self.ids)
    # Ids that end inside a character (token-id prompts may) are read again with the tokens that complete it.
    while self.read > self.prefix and tokenizer.decode(self.ids[self.prefix : self.read]).endswith("\ufffd"):
      self.read -= 1

  def add(self, token: int) -> str:
    """Appends one token; returns the new text it completes ("" while a character is unfinished)."""
    self.ids.append(token)
    before = self.tokenizer.decode(self.ids[self.prefix : self.read])
    after = self.tokenizer.decode(self.ids[self.prefix :])
    if after.endswith("\ufffd") or len(after) <= len(before):
      return ""
    self.prefix, self.read = max(len(self.ids) - self.CONTEXT, 0), len(self.ids)
    return after[len(before) :]

  def flush(self) -> str:
    """At the end: the text held back for an unfinished character (shown as the replacement character)."""
    before = self.tokenizer.decode(self.ids[self.prefix : self.read])
    after = self.tokenizer.decode(self.ids[self.prefix :])
    self.prefix = self.read = len(self.ids)
    return after[len(before) :] if after.startswith(before) else ""


def piece_text(tokenizer, token: int) -> str:
  """A token's own text for top_logprobs keys: its piece with "▁" as a space (byte pieces stay "<0xNN>"), unique
  per id so no alternative hides another."""
  return tokenizer.id_to_piece(token).replace("\u2581", " ")


class Choice:
  """One choice's text as tokens arrive: the detokenized text, stop strings (the text ends before the first one;
  while streaming, text that might begin a stop string is held back), and per-token log-probabilities."""

  def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: list[str], top_n: int | None, text_offset: int = 0):
    self.tokenizer, self.stop, self.top_n = tokenizer, stop, top_n
    self.detok = Detokenizer(tokenizer, prompt_ids)
    self.text = ""
    self.sent = 0  # characters of `text` already streamed
    self.stopped = False
    self.n_tokens = 0
    self.text_offset = text_offset  # where this text starts in the response's text (echo puts the prompt first)
    self.logprobs = LogprobList(tokenizer, top_n) if top_n is not None else None

  def add(self, tokens: Sequence[int], logprobs=None, top_logprobs=None) -> None:
    for i, token in enumerate(tokens):
      if self.stopped:
        return
      piece = self.detok.add(token)
      start = len(self.text)
      self.text += piece
      self.n_tokens += 1
      if self.logprobs is not None:
        self.logprobs.append(token, piece, self.text_offset + start, logprobs[i], top_logprobs[i])
      found = [at for s in self.stop if (at := self.text.find(s, max(start - len(s) + 1, 0))) >= 0]
      if found:  # the stop string that begins first wins
        self.text, self.stopped = self.text[: min(found)], True
      if self.stopped and self.logprobs is not None:
        self.logprobs.cut(self.text_offset + len(self.text))

  def finish(self) -> None:
    """The end of the tokens: text held back for an unfinished character is added (unless a stop string ended it)."""
    if not self.stopped:
      self.text += self.detok.flush()

  def add_eos(self, eos_id: int, logprob: float, top: list) -> None:
    """The eos that ended the text: no text, but listed with its log-probability, as OpenAI-compatible servers do
    (a loglikelihood client sums all listed tokens but the one generated, so eos must be listed when it is that
    token), and counted in usage."""
    self.n_tokens += 1
    if self.logprobs is not None:
      self.logprobs.append(eos_id, "", self.text_offset + len(self.text), logprob, top)

  def new_text(self, final: bool) -> str:
    """Text not yet streamed; unless final, minus a tail that could still grow into a stop string."""
    hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stop), default=0)
    end = max(len(self.text) - hold, self.sent)
    delta, self.sent = self.text[self.sent : end], end
    return delta


class LogprobList:
  """The per-token lists of OpenAI's `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

  def __init__(self, tokenizer, top_n: int):
    self.tokenizer, self.top_n = tokenizer, top_n
    self.tokens: list[str] = []
    self.ids: list[int] = []
    self.token_logprobs: list[float | None] = []
    self.top_logprobs: list[dict | None] = []
    self.text_offset: list[int] = []

  def append(self, token: int, text: str, offset: int, logprob: float | None, top: list | None) -> None:
    self.tokens.append(text)
    self.ids.append(token)
    self.token_logprobs.append(logprob)
    self.text_offset.append(offset)
    if top is None:
      self.top_logprobs.append(None)
    else:
      self.top_logprobs.append({piece_text(self.tokenizer, t): lp for t, lp in top[: self.top_n]})

  def cut(self, end_offset: int) -> None:
    """Drops the tokens that start at or after `end_offset` (cut by a stop string)."""
    keep = sum(1 for offset in self.text_offset if offset < end_offset)
    for field in (self.tokens, self.ids, self.token_logprobs, self.top_logprobs, self.text_offset):
      del field[keep:]

  def since(self, start: int) -> dict:
    """The completions API's logprobs object for tokens[start:]."""
    return {
      "tokens": self.tokens[start:],
      "token_logprobs": self.token_logprobs[start:],
      "top_logprobs": self.top_logprobs[start:],
      "text_offset": self.text_offset[start:],
    }

  def chat_since(self, start: int) -> dict:
    """The chat API's logprobs object ({"content": [{token, logprob, bytes, top_logprobs}]}) for tokens[start:]."""
    content = []
    for text, logprob, top in zip(self.tokens[start:], self.token_logprobs[start:], self.top_logprobs[start:]):
      alternatives = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in (top or {}).items()]
      content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": alternatives})
    return {"content": content}


def prompt_logprobs(
  tokenizer, prompt_ids: Sequence[int], logprobs, top_logprobs, top_n: int
) -> tuple[str, LogprobList]:
  """(text, logprobs) of an echoed prompt: each prompt token's text and offset, its log-probability given the tokens
  before (None for the first, as OpenAI reports), and the top alternatives at its position."""
  listing = LogprobList(tokenizer, top_n)
  detok = Detokenizer(tokenizer)
  text = ""
  for i, token in enumerate(prompt_ids):
    piece = detok.add(token)
    top = None if i == 0 else top_logprobs[i - 1]
    listing.append(token, piece, len(text), None if i == 0 else logprobs[i - 1], top)
    text += piece
  return text, listing
