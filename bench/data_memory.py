"""Peak host memory of one pass over a corpus, streamed (data.streaming, in the training process), prepared by the
single-process `text.prepare`, and prepared by the Apache Beam pipeline (`python -m llama_jax.prepare`, DirectRunner
in-process), on two corpora 10× apart in size: does it grow with the corpus?

    python bench/data_memory.py --copies 8,80 --json bench_data_memory.json

The corpus: the Shakespeare plays' paragraphs as JSONL (bench/data.py), `copies` files of ~5.7 MB each. Each figure
is the peak resident set (ru_maxrss) of a fresh process that imports the package, lists the corpus and reads it whole
once: streaming as 2,048 + 1-token windows in batches of 8, preparing into train.bin. Meta's LLaMA 2 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from data import META_TOKENIZER, write_corpus
from timing import cpu_name

ONE_PASS = """
import resource, sys
from llama_jax.data.sources import list_files
from llama_jax.data.tokenizer_files import load_tokenizer_path
mode, corpus, tokens, tokenizer = sys.argv[1], sys.argv[2], int(sys.argv[3]), load_tokenizer_path(sys.argv[4])
if mode == "streaming":
  from llama_jax.data import streaming
  data = streaming.StreamingDataset([list_files([corpus])], tokenizer, seq_len=2048, global_batch=8, seed=0)
  iterator, read = iter(data), 0
  while read < tokens:
    read += next(iterator)["inputs"].size + 8
elif mode == "prepare":
  from llama_jax.data import text
  text.prepare([corpus], [], tokenizer, corpus + "-prepared")
else:  # each mode imports only what it uses: Beam's import alone is ~140 MiB
  from llama_jax.core.run_config import RunConfig
  from llama_jax.data import pipeline
  config = RunConfig.from_dict(dict(data=dict(sources=(corpus,), val_sources=(), tokenizer=sys.argv[4])))
  pipeline.prepare(config, corpus + "-beam", tokenizer)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(mode: str, corpus: str, tokens: int, tokenizer: str) -> int:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
    [sys.executable, "-c", ONE_PASS, mode, corpus, str(tokens), tokenizer],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  return int(out.stdout.split()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--copies", default="8,80", help="corpus sizes, in copies of the plays")
  parser.add_argument("--tokenizer", default=META_TOKENIZER)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  rows = []
  for copies in (int(c) for c in args.copies.split(",")):
    with tempfile.TemporaryDirectory() as tmp:
      corpus = os.path.join(tmp, "corpus")
      os.makedirs(corpus)
      write_corpus(corpus, 1)
      first = os.path.join(corpus, "plays-00.jsonl")
      for c in range(1, copies):
        os.link(first, os.path.join(corpus, f"plays-{c:02d}.jsonl"))
      size = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus))
      tokens = 1_690_000 * copies  # the plays are 1.69M tokens with Meta's tokenizer (bench/data.py)
      row = dict(copies=copies, bytes=size)
      for mode in ("streaming", "prepare", "beam"):
        row[mode] = peak_rss(mode, corpus, tokens, args.tokenizer)
      rows.append(row)
      print(
        f"{copies} copies, {size / 2**20:,.0f} MiB: peak RSS streaming {row['streaming'] / 2**20:,.0f} MiB, "
        f"prepare {row['prepare'] / 2**20:,.0f} MiB, Beam prepare {row['beam'] / 2**20:,.0f} MiB",
        flush=True,
      )
  print(cpu_name())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(cpu=cpu_name(), rows=rows), f, indent=2)


if __name__ == "__main__":
  main()
