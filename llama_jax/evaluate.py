"""Evaluate a checkpoint directory: loss, perplexity (per token and per word) and bits per byte.

    python -m llama_jax.evaluate --checkpoint DIR [--data PATHS ...] [--seq_len N] [--batch_size N]
        [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8] [--json FILE [--by_position]]
        [--rope theta=500000,scaling=llama3,factor=16,original_max_len=256]

Without --data, the run's own validation split (prepared in the workdir) is used; the checkpoint directory is all
that is needed otherwise (``inference/evaluation.py``). Windows may be longer than the model was trained on (its
max_seq_len): with --by_position that is the check of how a RoPE setting (--rope) carries past the training length.
"""

from __future__ import annotations

import json
import sys

from llama_jax import cli
from llama_jax.core.distributed import maybe_initialize_distributed
from llama_jax.core.errors import FlagError, run_or_exit
from llama_jax.inference import placement
from llama_jax.inference.evaluation import evaluate


def main(argv: list[str] | None = None) -> int:
  parser = cli.ArgumentParser(prog="python -m llama_jax.evaluate", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--checkpoint", required=True, help="llama_jax checkpoint directory (a workdir or convert output)"
  )
  parser.add_argument(
    "--data",
    nargs="*",
    default=[],
    help="files, directories or globs, local or gs:// (text, .jsonl[.gz|.zst], .parquet, ArrayRecord), or "
    "'shakespeare:...'",
  )
  parser.add_argument("--seq_len", type=int, default=0, help="tokens per window (default: the run's seq_len)")
  parser.add_argument("--batch_size", type=int, default=0, help="windows per batch (default: the run's batch_size)")
  parser.add_argument("--max_batches", type=int, default=0, help="0: the whole text")
  parser.add_argument("--text_field", default="text", help="JSONL field holding the text")
  parser.add_argument("--json", default="", help="also write the metrics to this JSON file")
  parser.add_argument(
    "--by_position", action="store_true", help="with --json: also the mean loss at each position of the windows"
  )
  parser.add_argument(
    "--rope",
    default="",
    help="read the weights at other rotary frequencies: comma-separated KEY=VALUE of "
    f"{', '.join(cli.ROPE_KEYS)} (e.g. scaling=llama3,factor=16,original_max_len=256)",
  )
  cli.add_model_flags(parser)
  args = parser.parse_args(argv)
  run_or_exit(_check_flags, args)
  rope = run_or_exit(cli.parse_rope, args.rope)
  maybe_initialize_distributed()
  mesh = run_or_exit(placement.decode_mesh, args.mesh)
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
    rope,
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


def _check_flags(args) -> None:
  for name in ("seq_len", "batch_size", "max_batches"):
    if getattr(args, name) < 0:
      raise FlagError(f"--{name} must be ≥ 0, got {getattr(args, name)}")
  if args.by_position and not args.json:
    raise FlagError("--by_position writes a loss per position into the --json file; pass --json FILE too")


if __name__ == "__main__":
  sys.exit(main())
