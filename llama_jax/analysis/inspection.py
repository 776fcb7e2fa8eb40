"""The inspection forward: one prompt through a model, keeping what the training and decoding paths do not return
(each layer's attention probabilities, the residual stream and what reads it), and the models and prompts it runs on.

It calls the model's own modules (each block's norms, projections, RoPE and MLP, the embedding and the head) and
forms the attention probabilities explicitly; the training and decoding paths keep their fused kernels and return
nothing extra. Its logits equal the model's (tested to 1e-6). Any checkpoint directory works (a training workdir, a
``convert --from_hf`` output, an SFT or LoRA workdir): the model, its tokenizer and its latest (or given) parameters
are read as ``sample`` and ``evaluate`` read them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.model_config import ModelConfig
from llama_jax.data import chat_template
from llama_jax.data.tokenization import Tokenizer
from llama_jax.model import attention as attention_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Block, Llama, stacked_unit


class VizError(LlamaJaxError, ValueError):
  """A picture cannot be made from these inputs; the message names the file, metric or value."""


# ---------------------------------------------------------------------------------------------------------------------
# The inspection forward


@dataclasses.dataclass(frozen=True)
class Inspection:
  """What one prompt does inside a model (float32 host arrays; T prompt tokens, L layers).

  logits_TV: the model's logits. attention_LNTS: each layer's attention probabilities per query head, query × key,
  exactly 0 above the diagonal (head n reads kv head n // G). residual_LTD: the residual stream entering each block,
  then (index L) the stream after the last one. normed_LTD: what reads it: each block's attention input (the
  normalised stream in a pre-norm block, the stream itself in a post-norm or norm-free one), then the LM head's input
  (after the final norm, if the model has one)."""

  logits_TV: np.ndarray
  attention_LNTS: np.ndarray
  residual_LTD: np.ndarray
  normed_LTD: np.ndarray


def blocks_of(model: Llama) -> list[Block]:
  """The model's blocks as separate modules, in order, in either layout (stacked: one slice of every parameter)."""
  if not model.stacked:
    return list(model.layers)
  graphdef, layer_state = nnx.split(model.layers)
  unit, n_units = stacked_unit(model.cfg)
  units = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], layer_state)) for i in range(n_units)]
  return units if unit is Block else [block for group in units for block in group.blocks]


def attention_probabilities(q_BTNH: jax.Array, k_BSKH: jax.Array) -> jax.Array:
  """Causal attention probabilities [B, N, T, S] (float32) as ``attention.xla_attention`` computes them: query heads
  grouped [K, G] over their kv head, scores in float32 scaled by 1/√H, the upper triangle masked. Masked entries are
  set to exactly 0 (the softmax leaves them at exp(-huge) = 0 in float32 already; the mask makes it a guarantee)."""
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  kv_len, n_kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(batch, q_len, n_kv_heads, n_heads // n_kv_heads, head_dim)
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  scores_BKGTS = scores_BKGTS * (1.0 / np.sqrt(head_dim))
  visible_TS = jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
  probs_BKGTS = jax.nn.softmax(jnp.where(visible_TS, scores_BKGTS, attention_lib.MASK_VALUE), axis=-1)
  probs_BKGTS = jnp.where(visible_TS, probs_BKGTS, 0.0)
  return probs_BKGTS.reshape(batch, n_heads, q_len, kv_len)  # head n = k·G + g, the grouping of the [K, G] view


def inspect_block(block: Block, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
  """(block output, attention input, attention probabilities [B, N, T, T]): the block's own forward with the
  attention kernel replaced by explicit probabilities, every other step its modules' own code."""
  attention = block.attention
  normed_BTD = block.norm_in(block.attention_norm, x_BTD)
  q_BTNH, k_BTKH, v_BTKH = attention.rotated_qkv(normed_BTD, positions_BT)
  probs_BNTS = attention_probabilities(q_BTNH, k_BTKH)
  batch, length, n_heads, head_dim = q_BTNH.shape
  n_kv_heads = k_BTKH.shape[2]
  probs_BKGTS = probs_BNTS.reshape(batch, n_kv_heads, n_heads // n_kv_heads, length, length).astype(v_BTKH.dtype)
  out_BTNH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BTKH).reshape(batch, length, n_heads, head_dim)
  h_BTD = block.norm_out(block.attention_norm, x_BTD + attention.output_projection(out_BTNH))
  return block.mlp_residual(h_BTD)[0], normed_BTD, probs_BNTS


def inspect_forward(model: Llama, tokens: Sequence[int]) -> Inspection:
  """Runs one prompt through `model` and keeps what happens inside (see ``Inspection``).

  Calls the model's own modules block by block, with each layer's attention probabilities formed explicitly, and
  keeps the residual stream and what reads it; its logits equal the model's. Eager, one prompt: it is for looking, not
  for speed. One jitted call with the layers unrolled was slower for deep models, its compile costing more than
  op-by-op dispatch.

  Args:
    model: the model, its layers stacked or not.
    tokens: the prompt's token ids, e.g. from `prompt_tokens`.

  Returns:
    The `Inspection`: float32 host arrays of the logits [T, V], each layer's attention probabilities [L, N, T, T],
      and the residual stream and what reads it [L + 1, T, D].
  """
  tokens_BT = jnp.asarray(np.asarray(tokens, np.int32)[None])
  positions_BT = jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None]
  x_BTD = model.embed_tokens(tokens_BT)
  residuals, normed, probs = [], [], []
  for block in blocks_of(model):
    residuals.append(x_BTD)
    x_BTD, normed_BTD, probs_BNTS = inspect_block(block, x_BTD, positions_BT)
    normed.append(normed_BTD)
    probs.append(probs_BNTS)
  residuals.append(x_BTD)
  normed.append(x_BTD if model.final_norm is None else model.final_norm(x_BTD))
  logits_BTV = model.logits(x_BTD)

  def host(arrays):
    return np.stack([np.asarray(a[0], np.float32) for a in arrays])

  return Inspection(
    logits_TV=np.asarray(logits_BTV[0], np.float32),
    attention_LNTS=host(probs),
    residual_LTD=host(residuals),
    normed_LTD=host(normed),
  )


# ---------------------------------------------------------------------------------------------------------------------
# Models and prompts


def parse_changes(text: str) -> dict[str, Any]:
  """Model-config changes from "n_layers=32,norm=none" → {"n_layers": 32, "norm": "none"}: each value read as JSON
  (numbers, true/false) where it parses, as a string otherwise. The ModelConfig they build checks names and values."""
  changes: dict[str, Any] = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise VizError(f"model change {item!r} must be KEY=VALUE (e.g. n_layers=32,norm=none)")
    try:
      changes[key.strip()] = json.loads(value)
    except json.JSONDecodeError:
      changes[key.strip()] = value.strip()
  return changes


@dataclasses.dataclass
class LoadedModel:
  name: str  # as the pictures label it
  checkpoint_dir: str
  model: Llama
  tokenizer: Tokenizer
  init: str | None  # the model-config changes of a random initialisation, None for the trained parameters


def load_model(
  checkpoint_dir: str, step: int | None = None, init: str | None = None, seed: int = 0, name: str = ""
) -> LoadedModel:
  """A checkpoint directory's model and tokenizer: its stored parameters (``params.load_params``, the latest or
  `step`, on one device; a LoRA workdir's merged), or with `init` ("" or changes such as "n_layers=32,norm=none") a
  random initialisation (seed `seed`) of its model config with those changes: the architecture before training."""
  cfg = checkpoint_params.read_model_config(checkpoint_dir)
  tokenizer = checkpoint_params.load_tokenizer(checkpoint_dir, "the pictures need its tokenizer")
  name = name or paths.name(checkpoint_dir)
  if init is None:
    cfg, params = checkpoint_params.load_params(checkpoint_dir, step=step)
    model = nnx.merge(sharding.abstract_params(Llama, cfg)[0], params)
  else:
    cfg = ModelConfig.from_dict({**cfg.to_dict(), **parse_changes(init)})
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    name = f"{name} init" + (f" ({init})" if init else "")
  return LoadedModel(name, checkpoint_dir, model, tokenizer, init)


def prompt_tokens(tokenizer: Tokenizer, prompt: str, as_chat: bool = False) -> list[int]:
  """The prompt's ids as a document starts (bos first where the tokenizer adds one), or with `as_chat` a user turn in
  the checkpoint's chat template (LLaMA 2's without one) with the generation prompt."""
  if not prompt:
    raise VizError("--prompt must not be empty")
  if as_chat:
    return chat_template.encode_dialog(tokenizer, [{"role": "user", "content": prompt}]).tokens
  return tokenizer.encode(prompt, bos=True)


def token_labels(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
  """Tick labels: each token's vocabulary piece (sentencepiece's "▁" marks a leading space)."""
  return [tokenizer.id_to_piece(t) for t in tokens]


def check_prompt(loaded: LoadedModel, tokens: Sequence[int]) -> None:
  cfg = loaded.model.cfg
  if max(tokens) >= cfg.vocab_size:
    raise VizError(f"the prompt holds token id {max(tokens)}, past {loaded.name}'s vocab_size {cfg.vocab_size}")
  if len(tokens) > cfg.max_seq_len:
    raise VizError(f"the prompt is {len(tokens)} tokens, more than {loaded.name}'s max_seq_len {cfg.max_seq_len}")
