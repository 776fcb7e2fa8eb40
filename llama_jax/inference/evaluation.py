"""Evaluating a checkpoint directory: loss, perplexity (per token and per word) and bits per byte of the weights as
the sampler places them (``python -m llama_jax.evaluate`` is the command).

Without sources, the run's own validation split (prepared in the workdir) is used. The checkpoint directory is all
that is needed otherwise: model config, tokenizer and parameters come from it.

Word-level perplexity is exp(total nats / words), the figure wikitext results are quoted in: the nats of every scored
token (eos and bos included, as they are in the token perplexity) over the whitespace-separated words of the text
those tokens decode to (``scored_words``). It compares across tokenizers, where a per-token perplexity does not.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.data import sources as sources_lib
from llama_jax.data import text
from llama_jax.data.batches import eval_batches
from llama_jax.data.tokenization import Tokenizer
from llama_jax.inference import placement
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.model.loss import eval_step, perplexity, summarize_eval


def _run_settings(checkpoint_dir: str) -> dict:
  path = paths.path(checkpoint_dir, paths.RUN_CONFIG_FILE)
  return json.loads(path.read_text()) if path.is_file() else {}


def scored_words(windows: text.TokenWindows, n_windows: int, tokenizer: Tokenizer) -> int:
  """Whitespace-separated words (``str.split``) of exactly the text that the targets of the first `n_windows`
  windows stand for: the windows tile the stream, so their targets are tokens 1 .. n_windows·seq_len, which are cut
  at every bos and eos into pieces of one document each and decoded piece by piece (a word never joins the last word
  of the document before it). A word cut by the end of the scored span counts once; bos and eos count none."""
  span = np.asarray(windows.tokens[1 : 1 + n_windows * windows.seq_len])
  is_special = np.isin(span, (tokenizer.bos_id, tokenizer.eos_id))
  words = 0
  for piece in np.split(span, np.flatnonzero(is_special)):
    piece = piece[~np.isin(piece, (tokenizer.bos_id, tokenizer.eos_id))]
    if piece.size:
      words += len(tokenizer.decode(piece).split())
  return words


def _windows(checkpoint_dir: str, settings: dict, sources: Sequence[str], tokenizer, seq_len: int, text_field: str):
  """The windows evaluated: `sources` tokenized now, or the run's prepared validation split."""
  if sources:
    windows = text.TokenWindows(
      text.tokenize_documents(sources_lib.resolve_sources(sources), tokenizer, text_field), seq_len
    )
  else:
    prepared = settings.get("data", {}).get("prepared_dir") or paths.local_dir(checkpoint_dir, "data")
    if not os.path.isfile(os.path.join(prepared, "val.bin")):
      raise sources_lib.DataError(f"no validation split prepared for {checkpoint_dir!r}; pass --data PATHS")
    windows = text.validation_windows(prepared, seq_len)
  if len(windows) == 0:
    raise sources_lib.DataError(
      f"the evaluation text has fewer than {seq_len + 1} tokens; pass more text or a smaller --seq_len"
    )
  return windows


def evaluate(
  checkpoint_dir: str,
  sources: Sequence[str] = (),
  seq_len: int = 0,
  batch_size: int = 0,
  max_batches: int = 0,
  text_field: str = "text",
  mesh: Mesh | None = None,
  dtype: str | None = None,
  quantize: str = "none",
  step: int | None = None,
  by_position: bool = False,
  rope: dict | None = None,
) -> dict[str, float]:
  """Evaluate a checkpoint step on `sources`, or the run's validation split: loss, perplexity and bits per byte.

  The weights are placed as for decoding (``placement``: split over `tensor`, windows over `data`), cast to `dtype`
  and quantized as asked, so a loss measures exactly the weights the sampler would decode with. The text is cut into
  windows of `seq_len` tokens that tile it, whose targets are scored.

  Args:
    checkpoint_dir: the checkpoint directory: model config, tokenizer and parameters come from it.
    sources: source specs to tokenize and score: files, directories, globs or ``shakespeare``; empty: the run's
      prepared validation split.
    seq_len: tokens per window; 0: the run's ``train.seq_len``, else the smaller of the model's ``max_seq_len`` and
      1024.
    batch_size: windows per batch, a multiple of the mesh's data axis; 0: the run's ``train.batch_size``, else 8.
    max_batches: score at most this many batches; 0: all.
    text_field: the field that holds each record's text in sources of records such as JSONL.
    mesh: the decode mesh; None: one device.
    dtype: cast the weights and compute to this dtype; None: as stored.
    quantize: "int8": weight-only int8 with per-output-channel scales; "none": float.
    step: the checkpoint step; None: the latest complete one.
    by_position: also return "loss_by_position": the mean loss at each position 0 .. seq_len-1 of the windows, a
      list.
    rope: overrides of the checkpoint's rotary settings, as ModelConfig fields; RoPE has no weights.

  Returns:
    ``loss`` per token, ``perplexity``, ``bits_per_byte``, the scored ``tokens`` and ``words``, and
    ``word_perplexity``: exp(total nats / words), which compares across tokenizers; with `by_position`, also
    ``loss_by_position``.

  Raises:
    ConfigError: a bad `rope` value, refused before any weight is read.
    CheckpointError: the directory is not a llama_jax checkpoint, has no tokenizer, or has no complete step, not
      `step`, or damaged files.
    DataError: no validation split is prepared and no `sources` are given, or the text has fewer than
      `seq_len` + 1 tokens.
    InferenceError: `batch_size` is not a multiple of the mesh's data axis, or the mesh, dtype or quantization does
      not fit the model.
  """
  model_cfg = checkpoint_params.read_model_config(checkpoint_dir)
  model_cfg.replace(**(rope or {}))  # a bad --rope value is refused (ConfigError) before any weight is read
  tokenizer = checkpoint_params.load_tokenizer(checkpoint_dir, "evaluation needs one")
  settings = _run_settings(checkpoint_dir)
  seq_len = seq_len or settings.get("train", {}).get("seq_len") or min(model_cfg.max_seq_len, 1024)
  batch_size = batch_size or settings.get("train", {}).get("batch_size") or 8
  windows = _windows(checkpoint_dir, settings, sources, tokenizer, seq_len, text_field)
  mesh = mesh if mesh is not None else placement.decode_mesh(devices=jax.local_devices()[:1])
  if batch_size % mesh.shape["data"]:
    raise placement.InferenceError(
      f"batch_size {batch_size} must be a multiple of the mesh's data axis {mesh.shape['data']}"
    )
  model_cfg, params = placement.load_decode_params(
    checkpoint_dir, mesh, dtype=dtype, quantize=quantize, step=step, stacked=True
  )
  if rope:
    model_cfg = model_cfg.replace(**rope)
  rules = placement.decode_rules(model_cfg, mesh)
  graphdef = sharding.abstract_params(Llama, model_cfg)[0]
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", "activation_length"), rules))
  step = jax.jit(functools.partial(eval_step, graphdef=graphdef, by_position=by_position), out_shardings=replicated)
  token_bytes = jax.device_put(np.asarray(tokenizer.token_byte_lengths(), np.float32), replicated)
  totals = None
  with sharding.activate(mesh, rules):
    for batch in eval_batches(windows, batch_size, max_batches):
      batch = {k: jax.device_put(v, batch_sharding) for k, v in batch.items()}
      sums = step(params, batch, token_bytes)
      totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
  totals = jax.device_get(totals)
  metrics = summarize_eval({k: float(totals[k]) for k in ("loss_sum", "tokens", "bytes")})
  metrics["tokens"] = float(totals["tokens"])
  n_windows = min(len(windows), max_batches * batch_size) if max_batches else len(windows)
  metrics["words"] = float(scored_words(windows, n_windows, tokenizer))
  metrics["word_perplexity"] = perplexity(float(totals["loss_sum"]) / max(metrics["words"], 1.0))
  if by_position:
    metrics["loss_by_position"] = (totals["loss_by_position"] / np.maximum(totals["tokens_by_position"], 1)).tolist()
  return metrics
