"""Evaluate a checkpoint directory: loss, perplexity (per token and per word) and bits per byte.

    python -m llama_jax.evaluate --checkpoint DIR [--data PATHS ...] [--seq_len N] [--batch_size N]
        [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8] [--json FILE [--by_position]]

Without --data, the run's own validation split (prepared in the workdir) is used. The checkpoint directory is all
that is needed otherwise: model config, tokenizer and parameters come from it.

Word-level perplexity is exp(total nats / words), the figure wikitext results are quoted in: the nats of every scored
token (eos and bos included, as they are in the token perplexity) over the whitespace-separated words of the text
those tokens decode to (``scored_words``). It compares across tokenizers, where a per-token perplexity does not.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llama_jax import checkpoint as checkpoint_lib
from llama_jax import data as data_lib
from llama_jax import inference, sharding
from llama_jax.cli import ArgumentParser
from llama_jax.distributed import maybe_initialize_distributed
from llama_jax.errors import exit_with_error, run_or_exit
from llama_jax.loss import eval_step, perplexity, summarize_eval
from llama_jax.model import Llama
from llama_jax.tokenizer import TOKENIZER_FILE, Tokenizer


def _run_settings(checkpoint_dir: str) -> dict:
  path = os.path.join(checkpoint_dir, checkpoint_lib.RUN_CONFIG_FILE)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def scored_words(windows: data_lib.TokenWindows, n_windows: int, tokenizer: Tokenizer) -> int:
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
) -> dict[str, float]:
  """Metrics of the latest (or given) checkpoint step on `sources` (or the run's validation split), with the weights
  placed as for decoding (``inference``: split over `tensor`, windows over `data`; default one device), cast to
  `dtype` and quantized as asked, so a loss measures exactly the weights the sampler would decode with. With
  `by_position`, also "loss_by_position": the mean loss at each position 0 .. seq_len-1 of the windows (a list)."""
  model_cfg = checkpoint_lib.read_model_config(checkpoint_dir)
  tokenizer_path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
  if not os.path.isfile(tokenizer_path):
    raise checkpoint_lib.CheckpointError(f"{checkpoint_dir!r} has no {TOKENIZER_FILE}")
  tokenizer = Tokenizer(tokenizer_path)
  settings = _run_settings(checkpoint_dir)
  seq_len = seq_len or settings.get("train", {}).get("seq_len") or min(model_cfg.max_seq_len, 1024)
  batch_size = batch_size or settings.get("train", {}).get("batch_size") or 8
  if sources:
    windows = data_lib.TokenWindows(
      data_lib.tokenize_documents(data_lib.resolve_sources(sources), tokenizer, text_field), seq_len
    )
  else:
    prepared = settings.get("data", {}).get("prepared_dir") or os.path.join(checkpoint_dir, "data")
    if not os.path.isfile(os.path.join(prepared, "val.bin")):
      raise data_lib.DataError(f"no validation split prepared for {checkpoint_dir!r}; pass --data PATHS")
    windows = data_lib.validation_windows(prepared, seq_len)
  if len(windows) == 0:
    raise data_lib.DataError(
      f"the evaluation text has fewer than {seq_len + 1} tokens; pass more text or a smaller --seq_len"
    )

  mesh = mesh if mesh is not None else inference.decode_mesh(devices=jax.local_devices()[:1])
  if batch_size % mesh.shape["data"]:
    raise inference.InferenceError(
      f"batch_size {batch_size} must be a multiple of the mesh's data axis {mesh.shape['data']}"
    )
  model_cfg, params = inference.load_params(
    checkpoint_dir, mesh, dtype=dtype, quantize=quantize, step=step, stacked=True
  )
  rules = inference.decode_rules(model_cfg, mesh)
  graphdef = sharding.abstract_params(Llama, model_cfg)[0]
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", "activation_length"), rules))
  step = jax.jit(functools.partial(eval_step, graphdef=graphdef, by_position=by_position), out_shardings=replicated)
  token_bytes = jax.device_put(np.asarray(tokenizer.token_byte_lengths(), np.float32), replicated)
  totals = None
  with sharding.activate(mesh, rules):
    for batch in data_lib.eval_batches(windows, batch_size, max_batches):
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


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m llama_jax.evaluate", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--checkpoint", required=True, help="llama_jax checkpoint directory (a workdir or convert output)"
  )
  parser.add_argument("--data", nargs="*", default=[], help="files, directories, globs, *.jsonl or 'shakespeare:...'")
  parser.add_argument("--seq_len", type=int, default=0, help="tokens per window (default: the run's seq_len)")
  parser.add_argument("--batch_size", type=int, default=0, help="windows per batch (default: the run's batch_size)")
  parser.add_argument("--max_batches", type=int, default=0, help="0: the whole text")
  parser.add_argument("--text_field", default="text", help="JSONL field holding the text")
  parser.add_argument("--json", default="", help="also write the metrics to this JSON file")
  parser.add_argument(
    "--by_position", action="store_true", help="with --json: also the mean loss at each position of the windows"
  )
  inference.add_model_flags(parser)
  args = parser.parse_args(argv)
  for name in ("seq_len", "batch_size", "max_batches"):
    if getattr(args, name) < 0:
      exit_with_error(f"--{name} must be ≥ 0, got {getattr(args, name)}")
  if args.by_position and not args.json:
    exit_with_error("--by_position writes a loss per position into the --json file; pass --json FILE too")
  maybe_initialize_distributed()
  mesh = run_or_exit(inference.decode_mesh, args.mesh)
  metrics = run_or_exit(
    evaluate,
    args.checkpoint,
    args.data,
    args.seq_len,
    args.batch_size,
    args.max_batches,
    args.text_field,
    mesh,
    args.dtype,
    args.quantize,
    args.step,
    args.by_position,
  )
  print(
    f"loss {metrics['loss']:.4f} | perplexity {metrics['perplexity']:.2f} | word perplexity "
    f"{metrics['word_perplexity']:.2f} | bits/byte {metrics['bits_per_byte']:.4f} | tokens "
    f"{int(metrics['tokens']):,} | words {int(metrics['words']):,}"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(metrics, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
