"""Train a sentencepiece BPE tokenizer on text files.

    python -m llama_jax.tokenizer --input PATHS [PATHS ...] --vocab_size N --out DIR [--overwrite]

Lossless (byte fallback, no normalisation) in Meta's layout: unk=0, bos=1, eos=2, no pad (``data/tokenization.py``).
"""

from __future__ import annotations

import logging
import os
import sys

from llama_jax.cli import ArgumentParser
from llama_jax.core.errors import run_or_exit
from llama_jax.core.paths import TOKENIZER_FILE
from llama_jax.data.tokenization import Tokenizer, corpus_stats, expand_inputs, train_tokenizer


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m llama_jax.tokenizer", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--input",
    nargs="+",
    required=True,
    metavar="PATHS",
    help="text files, directories (every file below) or glob patterns",
  )
  parser.add_argument("--vocab_size", type=int, required=True, help="number of tokens, e.g. 32000")
  parser.add_argument("--out", required=True, metavar="DIR", help=f"directory to write {TOKENIZER_FILE} to")
  parser.add_argument("--overwrite", action="store_true", help=f"replace an existing DIR/{TOKENIZER_FILE}")
  parser.add_argument("--num_threads", type=int, default=os.cpu_count() or 2, help="sentencepiece trainer threads")
  parser.add_argument("--verbose", action="store_true", help="show sentencepiece's training log")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
  files = run_or_exit(expand_inputs, args.input)
  model_path = run_or_exit(
    train_tokenizer,
    files,
    args.vocab_size,
    args.out,
    num_threads=args.num_threads,
    overwrite=args.overwrite,
    verbose=args.verbose,
  )
  tokenizer = Tokenizer(model_path)
  stats = run_or_exit(corpus_stats, tokenizer, files)
  print(f"wrote {model_path}")
  print(f"vocab size: {tokenizer.vocab_size}")
  print(f"replaced bytes: {stats.replaced_bytes} (not valid UTF-8, read as U+FFFD)")
  print(
    f"bytes/token: {stats.bytes_per_token:.3f} ({stats.bytes:,} bytes, {stats.tokens:,} tokens, {len(files)} files)"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
