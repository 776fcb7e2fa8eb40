"""Text on a terminal over the ``Sampler``: a printer that streams tokens as text, and the multi-turn chat session of
``python -m llama_jax.sample --chat`` (turns from the terminal, or one per line of stdin when it is not one)."""

from __future__ import annotations

import sys

import numpy as np

from llama_jax.data import chat_template
from llama_jax.inference.sampler import Sampler
from llama_jax.inference.sampling import SamplingConfig


class TextStream:
  """Prints one row's text as tokens arrive (decoding the whole row each time, so multi-byte pieces come out whole)."""

  def __init__(self, tokenizer, prompt_ids: list[int], stops: set[int]):
    # Decoding prompt + continuation keeps the space the first new token carries (sentencepiece drops a leading one).
    self.tokenizer, self.stops, self.ids, self.stopped = tokenizer, stops, list(prompt_ids), False
    self.printed = tokenizer.decode(self.ids)
    sys.stdout.write(self.printed)

  def __call__(self, new_tokens: np.ndarray, done: np.ndarray) -> None:
    for token in new_tokens[0].tolist():
      if self.stopped or token in self.stops:
        self.stopped = True
        break
      self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    if text.startswith(self.printed):
      sys.stdout.write(text[len(self.printed) :])
      sys.stdout.flush()
      self.printed = text


def chat_session(
  sampler: Sampler,
  tokenizer,
  *,
  system: str | None,
  sampling: SamplingConfig,
  max_new_tokens: int,
  seed: int,
  turns,
  interactive: bool,
) -> None:
  """A multi-turn chat: each user turn from `turns` (an iterator of lines) gets a reply, with the whole history in
  the checkpoint's chat template (LLaMA 2's when it has none). When history and reply would overflow max_seq_len, the
  oldest exchanges are dropped, with a notice on stderr. Interactive sessions stream the reply."""
  history: list[dict] = []
  for turn_index, line in enumerate(turns):
    user = line.strip()
    if not user:
      continue
    messages = (
      ([{"role": "system", "content": system}] if system else []) + history + [{"role": "user", "content": user}]
    )
    encoded = chat_template.encode_dialog(tokenizer, messages, max_len=sampler.cfg.max_seq_len - max_new_tokens)
    if encoded.dropped_exchanges:
      history = history[2 * encoded.dropped_exchanges :]
      print(f"[context window full: dropped the oldest {encoded.dropped_exchanges} exchange(s)]", file=sys.stderr)
    if encoded.truncated:
      print("[this message is longer than the context window: its beginning was cut]", file=sys.stderr)
    if interactive:
      printer = TextStream(tokenizer, [], set(tokenizer.stop_ids))
      reply_ids = sampler.generate(
        [encoded.tokens], max_new_tokens, sampling, seed + turn_index, chunk=8, on_tokens=printer
      )[0]
      sys.stdout.write("\n")
    else:
      reply_ids = sampler.generate([encoded.tokens], max_new_tokens, sampling, seed + turn_index)[0]
      print(" ".join(tokenizer.decode(reply_ids).split()), flush=True)  # one line per reply, for scripts
    history += [{"role": "user", "content": user}, {"role": "assistant", "content": tokenizer.decode(reply_ids)}]


def interactive_turns():
  """Lines typed at a "> " prompt, until end of input."""
  while True:
    try:
      yield input("> ")
    except EOFError:
      return
