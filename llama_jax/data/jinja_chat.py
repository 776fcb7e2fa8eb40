"""A checkpoint's own chat template (Jinja, from tokenizer_config.json or chat_template.jinja), rendered as
transformers' ``apply_chat_template`` renders it, and the assistant-token mask derived from it.

Rendering: the same Jinja environment transformers builds (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop
controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text) with the special tokens as
variables (``bos_token``, ``eos_token``, ...). The rendered text is encoded with special-token strings read as their
ids, as transformers does; the ids equal ``apply_chat_template(..., tokenize=True)`` (tests/data/test_jinja_chat.py).

The assistant mask comes from **incremental rendering**, so it works for any template, not only those with
``{% generation %}`` blocks (few have them; the blocks are accepted and render their content): for each assistant
message i, the conversation up to i-1 rendered with the generation prompt is where its text starts, the conversation
up to i rendered without it is where it ends (each a prefix of the whole rendering, or the template is refused);
the reply's tokens are those of the whole conversation's ids whose text ends between the two. The span ends at the
template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``): the model learns to emit it and decoding
stops on it; what a template writes after it (ChatML's newline) is not trained.

User text cannot forge a turn: a special token's text inside a message is encoded as plain text (transformers'
``sanitize_control_tokens=True``; its default encodes it as the special id).
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llama_jax.core.errors import LlamaJaxError
from llama_jax.data.chat_template import ConversationError, EncodedConversation, cut_to_length

# Marks special-token text inside message contents, to encode it as plain text: a code point of plane 15's private use
# area that no tokenizer gives a meaning to; removed from contents first, so it never comes from input.
PLAIN_MARK = "\U000f0000"


class ChatTemplateError(LlamaJaxError, ValueError):
  """A chat template that does not compile or fails while rendering; the message names the template and line."""


class _TemplateRejects(Exception):
  """raise_exception(...) called by the template: the conversation is not one it accepts."""


class _Generation(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` (transformers' assistant-tracking tag) renders its body: templates
  that carry it must compile; the mask comes from incremental rendering either way."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message):
  raise _TemplateRejects(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _template_line() -> int | None:
  """The template line being rendered when the current exception was raised (Jinja keeps it in the traceback)."""
  tb, line = sys.exc_info()[2], None
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == "<template>":
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


class JinjaChatTemplate:
  """One checkpoint's chat template. `variables` are the special tokens' texts (bos_token, eos_token, ...); `name`
  says where the template came from, for messages."""

  def __init__(self, source: str, name: str, variables: Mapping[str, str]):
    if not isinstance(source, str) or not source.strip():
      raise ChatTemplateError(f"{name}: the chat template is empty")
    self.source, self.name, self.variables = source, name, dict(variables)
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ChatTemplateError(f"{name}: the chat template does not compile, line {e.lineno}: {e.message}") from None

  def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """The template's text for `messages`. ConversationError with the template's own words when it rejects them
    (``raise_exception``); ChatTemplateError naming the line when it fails otherwise."""
    try:
      return self._template.render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tools=None,
        documents=None,
        **self.variables,
      )
    except _TemplateRejects as e:
      raise ConversationError(f"the chat template rejects this conversation: {e}") from None
    except Exception as e:  # noqa: BLE001 -- anything a template can raise while rendering (undefined, type errors)
      line = _template_line()
      where = f", line {line}" if line else ""
      raise ChatTemplateError(f"{self.name}: the chat template failed to render{where}: {e}") from None

  def end_of_turn_id(self, encode: Callable[[str], list[int]], special_ids: frozenset[int]) -> int | None:
    """The special token the template writes right after an assistant's text (the model's "my turn is over"), or
    None when there is none or the template refuses the probe conversation."""
    probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    try:
      prompt = self.render(probe[:1], True)
      full = self.render(probe, False)
    except (ConversationError, ChatTemplateError):
      return None
    at = full.find("2", len(prompt) if full.startswith(prompt) else 0)
    if at < 0:
      return None
    return next((t for t in encode(full[at + 1 :]) if t in special_ids), None)

  def encode(self, tokenizer, messages: Sequence[Mapping[str, str]], max_len: int | None = None) -> EncodedConversation:
    """Ids and assistant mask of a conversation ending with an assistant turn (training) or a user turn (a prompt,
    with the generation prompt added). Longer than `max_len`: the oldest exchanges are dropped, then the left of the
    last prompt is cut, as the LLaMA 2 path does (chat_template.encode_dialog)."""
    messages = [dict(m, content=m["content"].replace(PLAIN_MARK, "")) for m in messages]
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    tokens, mask = self._encode_whole(tokenizer, messages)
    if max_len is not None and len(tokens) > max_len and len(turns) > 2:
      dropped, (tokens, mask) = self._fewest_dropped(tokenizer, system, turns, max_len, len(tokens))
    tokens, mask, truncated = cut_to_length(tokens, mask, max_len)
    return EncodedConversation(tokens, mask, dropped, truncated)

  def _fewest_dropped(
    self, tokenizer, system: list[dict], turns: list[dict], max_len: int, whole: int
  ) -> tuple[int, tuple[list[int], list[int]]]:
    """(d, its encoding): the fewest oldest exchanges to drop so that the rest fits `max_len`, keeping at least the
    last exchange. The answer a scan d = 1, 2, ... finds, from fewer encodings: each costs one template rendering per
    turn, and the scan encoded a long conversation once per exchange dropped (much slower than this, with the same
    results: (BENCHMARKS.md, "Figures behind the code")). This starts at the estimate of the turns'
    content tokens plus the template's measured markup per message, then steps down while the one before fits or up
    while it does not."""
    most = max(0, -(-(len(turns) - 2) // 2))  # the scan stops once at most two turns are left
    content = [len(tokenizer.encode(m["content"])) for m in system + turns]
    markup = max(0.0, (whole - sum(content)) / len(content))
    kept_system = sum(content[: len(system)]) + markup * len(system)
    turn_tokens = content[len(system) :]

    def estimate(d: int) -> float:
      kept = turn_tokens[2 * d :]
      return kept_system + sum(kept) + markup * len(kept)

    encodings: dict[int, tuple[list[int], list[int]]] = {}

    def fits(d: int) -> bool:
      if d not in encodings:
        encodings[d] = self._encode_whole(tokenizer, system + turns[2 * d :])
      return len(encodings[d][0]) <= max_len

    d = next((d for d in range(1, most + 1) if estimate(d) <= max_len), most)
    if fits(d):
      while d > 1 and fits(d - 1):
        d -= 1
    else:
      while d < most and not fits(d):
        d += 1
      fits(d)
    return d, encodings[d]

  def _encode_whole(self, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) of all of `messages`, a training conversation ending where its last reply does."""
    marked = self._marked(tokenizer, messages)
    generation_prompt = messages[-1]["role"] != "assistant"
    full_text = self.render(marked, generation_prompt)
    ids, ends = tokenizer.encode_rendered(full_text, PLAIN_MARK)
    mask = [0] * len(ids)
    eot = tokenizer.end_of_turn_id
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      before = self.render(marked[:i], True)
      through = self.render(marked[: i + 1], False)
      if not (through.startswith(before) and full_text.startswith(through)):
        raise ChatTemplateError(
          f"{self.name}: the chat template renders earlier turns differently once later turns follow, so the "
          "assistant tokens cannot be found by rendering the conversation turn by turn"
        )
      # Tokens whose text ends inside the generation prompt are the prompt's; those that end inside this turn's
      # rendering, after it, are the reply's (a token straddling the boundary, "\nHello", is the reply's).
      start = bisect.bisect_right(ends, len(before.replace(PLAIN_MARK, "")))
      end = bisect.bisect_right(ends, len(through.replace(PLAIN_MARK, "")))
      if eot is not None and eot in ids[start:end]:
        end = start + ids[start:end].index(eot) + 1
      mask[start:end] = [1] * (end - start)
    if messages[-1]["role"] == "assistant" and any(mask):
      # What a template writes after the last reply's end-of-turn token (ChatML's newline) is no one's to predict:
      # a training sequence ends where the reply does, as LLaMA 2's ends with eos (DPO reads the reply at the end).
      last = len(mask) - mask[::-1].index(1)
      ids, mask = ids[:last], mask[:last]
    return ids, mask

  @staticmethod
  def _marked(tokenizer, messages: list[dict]) -> list[dict]:
    """Messages with every special token's text in their contents wrapped in PLAIN_MARKs."""
    texts = sorted(tokenizer.special_texts, key=len, reverse=True)  # longest first: "<|im_end|>" before "<|im"
    if not texts:
      return messages
    pattern = re.compile("|".join(map(re.escape, texts)))
    return [dict(m, content=pattern.sub(lambda t: f"{PLAIN_MARK}{t[0]}{PLAIN_MARK}", m["content"])) for m in messages]
