"""Time between tokens of a running stream while a long prompt arrives: the engine's whole-prompt prefill against its
interleaved (chunked) prefill, side by side in one run.

    python bench/prefill.py --json bench_prefill.json     # a 4,000-token prompt, chunks of 256 and 512 (minutes)
    python bench/prefill.py --quick                       # smoke run on a 300-token prompt (seconds)

A stories15M-shaped model (random weights, float32, CPU) with max_seq_len raised to hold the prompt, in an `Engine`
of 4 slots and 8 decode steps per call, stepped on this thread. One request decodes (a 16-token prompt) until it has
its first tokens; then the long prompt is submitted. Measured from that moment until the long request's first token
(its time to first token): the gaps between the running stream's outputs (each a decode call's tokens), their
largest and median, and how many tokens the stream got meanwhile. Each setting runs the scenario once untimed
(compiles) and then `--repeats` times; figures are the medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from decode import SHAPES  # noqa: E402
from flax import nnx  # noqa: E402
from timing import cpu_name  # noqa: E402

from llama_jax.inference.engine import Engine  # noqa: E402
from llama_jax.inference.requests import Request  # noqa: E402
from llama_jax.inference.sampler import Sampler  # noqa: E402
from llama_jax.model.llama import Llama  # noqa: E402


def scenario(engine: Engine, long_prompt: list[int], vocab: int) -> dict:
  """One run: a stream decoding, the long prompt arriving, both to the long request's first token."""
  stream_times, first = [], []
  running = Request(
    np.random.RandomState(1).randint(3, vocab, 16).tolist(),
    engine.max_len - 16,  # runs past the long prompt's first token, then is cancelled
    lambda output: stream_times.append((time.perf_counter(), len(output.tokens))),
  )
  engine.submit(running)
  while len(stream_times) < 3:  # admitted, first decode calls out
    engine.step()
  arrived = time.perf_counter()
  engine.submit(Request(long_prompt, 4, lambda output: first.append(time.perf_counter()) if output.tokens else None))
  while not first:
    engine.step()
  engine.cancel(running)
  while engine.pending():
    engine.step()
  window = [t for t, _ in stream_times if arrived <= t <= first[0]]
  gaps = np.diff([arrived, *window, first[0]])
  return dict(
    ttft_s=first[0] - arrived,
    max_gap_s=float(gaps.max()),
    median_gap_s=float(np.median(gaps)),
    stream_tokens=sum(n for t, n in stream_times if arrived <= t <= first[0]),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompt_tokens", type=int, default=4000)
  parser.add_argument("--chunks", default="0,256,512", help="prefill_chunk settings (0: whole prompts)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="a 300-token prompt, chunks 0 and 64, one repeat")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  if args.quick:
    args.prompt_tokens, args.chunks, args.repeats = 300, "0,64", 1
  max_len = 1 << (args.prompt_tokens + 64).bit_length()
  cfg = SHAPES["stories15M"].replace(max_seq_len=max_len)
  sampler = Sampler(cfg, nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))), eos_id=-1, pad_id=0)
  long_prompt = np.random.RandomState(0).randint(3, cfg.vocab_size, args.prompt_tokens).tolist()
  rows = []
  for chunk in (int(c) for c in args.chunks.split(",")):
    engine = Engine(sampler, slots=4, max_len=max_len, prefill_chunk=chunk)
    scenario(engine, long_prompt, cfg.vocab_size)  # compiles every program the scenario uses
    runs = [scenario(engine, long_prompt, cfg.vocab_size) for _ in range(args.repeats)]
    row = {"prefill_chunk": chunk, **{k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}}
    rows.append(row)
    print(json.dumps(row), flush=True)
  result = {
    "cpu": cpu_name(),
    "cores": os.cpu_count(),
    "prompt_tokens": args.prompt_tokens,
    "max_len": max_len,
    "rows": rows,
  }
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
