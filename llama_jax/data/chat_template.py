"""The LLaMA 2 chat format, built from token ids, shared by SFT data and the chat CLI: the default for checkpoints
whose tokenizer comes without a chat template of its own (those that have one use it: ``jinja_chat.py``).

Meta's format (``llama/generation.py``): each user → assistant exchange is

    <s>[INST] {user} [/INST] {assistant} </s>

with bos/eos as token *ids* around the encoded text, and an optional system prompt folded into the first user turn as
``<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}``. A prompt for generation ends with ``<s>[INST] {user} [/INST]``
and no eos.
Contents are stripped as Meta does. bos/eos are never produced from text: sentencepiece encodes a literal "<s>" or
"</s>" in a message as ordinary characters, so user text cannot forge a turn boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llama_jax.core.errors import LlamaJaxError

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
ROLES = ("system", "user", "assistant")


class ConversationError(LlamaJaxError, ValueError):
  """A conversation that does not follow the chat format; the message says what is wrong."""


class ConversationTooLong(ConversationError):
  """The last assistant turn alone does not fit the length allowed."""


@dataclasses.dataclass(frozen=True)
class EncodedConversation:
  """Token ids of a conversation and a 0/1 loss mask: 1 exactly on assistant tokens and their closing eos."""

  tokens: list[int]
  loss_mask: list[int]
  dropped_exchanges: int = 0  # oldest exchanges removed to fit the length limit
  truncated: bool = False  # the last exchange's prompt was cut from the left to fit


def check_conversation(messages: Sequence[dict], *, for_training: bool = True) -> None:
  """Raises ConversationError unless: an optional system message first, then user/assistant alternating from a user
  turn, non-empty string contents, and (for training) at least one assistant turn, the last message an assistant's."""
  if not messages:
    raise ConversationError("no messages")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
      raise ConversationError(f"message {i} must be an object with 'role' and 'content'")
    if message["role"] not in ROLES:
      raise ConversationError(f"message {i} has unknown role {message['role']!r}; roles are {', '.join(ROLES)}")
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
      raise ConversationError(f"message {i} ({message['role']}) has empty content")
  turns = messages[1:] if messages[0]["role"] == "system" else messages
  for i, message in enumerate(turns):
    expected = "user" if i % 2 == 0 else "assistant"
    if message["role"] != expected:
      where = i + (len(messages) - len(turns))
      raise ConversationError(
        f"message {where} is {message['role']!r} but {expected!r} was expected: turns must "
        f"alternate user, assistant after an optional first system message"
      )
  if for_training:
    if not any(m["role"] == "assistant" for m in turns):
      raise ConversationError("no assistant turn")
    if turns[-1]["role"] != "assistant":
      raise ConversationError("the conversation does not end with an assistant turn")
  elif not turns or turns[-1]["role"] != "user":
    raise ConversationError("a prompt must end with a user turn")


def _exchanges(messages: Sequence[dict]) -> tuple[str | None, list[tuple[str, str | None]]]:
  system = messages[0]["content"].strip() if messages[0]["role"] == "system" else None
  turns = [m["content"].strip() for m in (messages[1:] if system is not None else messages)]
  return system, [(turns[i], turns[i + 1] if i + 1 < len(turns) else None) for i in range(0, len(turns), 2)]


def _user_text(user: str, system: str | None) -> str:
  return f"{B_SYS}{system}{E_SYS}{user}" if system is not None else user


def encode_exchange(tokenizer, user: str, assistant: str | None, system: str | None = None) -> tuple[list[int], int]:
  """(ids, prompt length) of one exchange: bos + "[INST] {user} [/INST] {assistant} " + eos, or, without an
  assistant, the generation prompt bos + "[INST] {user} [/INST]". The first `prompt length` ids are the prompt."""
  prompt = f"{B_INST} {_user_text(user, system)} {E_INST}"
  prompt_ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
  if assistant is None:
    return prompt_ids, len(prompt_ids)
  # Encoded as one string, exactly as Meta does; the prompt's ids are a prefix of it (the text after [/INST] starts
  # with a space, where BPE pieces begin), so the boundary is exact. If a vocabulary ever merged across it, the
  # shared prefix is the prompt and the loss covers the first differing token onwards.
  ids = [tokenizer.bos_id] + tokenizer.encode(f"{prompt} {assistant} ") + [tokenizer.eos_id]
  boundary = 0
  while boundary < len(prompt_ids) and ids[boundary] == prompt_ids[boundary]:
    boundary += 1
  return ids, boundary


def encode_dialog(tokenizer, messages: Sequence[dict], max_len: int | None = None) -> EncodedConversation:
  """Token ids and loss mask of a conversation, in the tokenizer's chat template or else in LLaMA 2's.

  The conversation ends with an assistant turn, for training, or with a user turn, for a generation prompt. The
  tokenizer's own chat template is used when its checkpoint has one (``jinja_chat.py``). Longer than `max_len`: the
  oldest exchanges are dropped, the system prompt moving to the first one kept; if the last exchange alone is too
  long, its prompt is cut from the left, keeping the last assistant turn whole.

  Args:
    tokenizer: the tokenizer that encodes the text, with its bos and eos ids and its chat template, if any.
    messages: {"role", "content"} dicts: an optional system message, then user and assistant turns alternating from
      a user turn, as `check_conversation` accepts them.
    max_len: the most tokens the result may hold, or None for no limit.

  Returns:
    The `EncodedConversation`: the token ids, a 0/1 loss mask that is 1 exactly on assistant tokens and their
      closing eos, the number of oldest exchanges dropped, and whether the last prompt was cut.

  Raises:
    ConversationTooLong: the last assistant turn alone is longer than `max_len`.
    ConversationError: the checkpoint's chat template rejects the conversation.
    ChatTemplateError: the checkpoint's chat template fails to render.
  """
  template = getattr(tokenizer, "chat_template", None)
  if template is not None:
    return template.encode(tokenizer, messages, max_len)
  system, exchanges = _exchanges(messages)
  encoded = []
  for i, (user, assistant) in enumerate(exchanges):
    encoded.append(encode_exchange(tokenizer, user, assistant, system if i == 0 else None))
  dropped = 0
  if max_len is not None:
    while len(encoded) > 1 and sum(len(ids) for ids, _ in encoded) > max_len:
      dropped += 1
      user, assistant = exchanges[dropped]
      encoded = [encode_exchange(tokenizer, user, assistant, system)] + encoded[2:]
  tokens, mask = [], []
  for ids, boundary in encoded:
    tokens += ids
    mask += [0] * boundary + [1] * (len(ids) - boundary)
  tokens, mask, truncated = cut_to_length(tokens, mask, max_len)
  return EncodedConversation(tokens, mask, dropped, truncated)


def cut_to_length(tokens: list[int], mask: list[int], max_len: int | None) -> tuple[list[int], list[int], bool]:
  """(tokens, mask, truncated): cut from the left to `max_len`, which must leave every masked (assistant) token."""
  if max_len is None or len(tokens) <= max_len:
    return tokens, mask, False
  cut = len(tokens) - max_len
  if sum(mask[cut:]) != sum(mask):
    raise ConversationTooLong(f"the last assistant turn alone is {sum(mask)} tokens, more than the {max_len} allowed")
  return tokens[cut:], mask[cut:], True
