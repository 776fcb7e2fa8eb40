"""The server under concurrent clients against the same prompts decoded one after another offline.

    python bench/serve.py [--clients 1,4,16] [--requests 32] [--max_tokens 64] [--slots 16] [--json F]

A stories15M-shaped model (random weights, float32, CPU; Meta's LLaMA 2 tokenizer for text) is served by
`python -m llama_jax.serve` in its own process on 127.0.0.1. For each client count C, C threads send the same
`--requests` greedy streamed completions (prompts of 16–64 random tokens, `--max_tokens` new ones), each client one
request at a time. Reported: generated tokens per second over the whole run, and time to first token (request sent →
first streamed text) at p50 and p95. The reference is the sample CLI's library path (``load_sampler`` +
``Sampler.generate``) decoding the same prompts one after another in this process: its tokens/s, and its time to
first token for one request alone (prefill + first chunk of 4 tokens, as `sample` streams). Both run greedy over the
same prompts, so they generate the same tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import load
import numpy as np
from decode import SHAPES
from flax import nnx
from timing import cpu_name

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.inference.engine import STEPS_PER_CALL
from llama_jax.inference.sampler import load_sampler
from llama_jax.model.llama import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META_TOKENIZER = os.path.join(ROOT, "..", "shared", "fixtures", "llama2-tokenizer", "tokenizer.model")


def make_checkpoint(directory: str, tokenizer: str) -> str:
  cfg = SHAPES["stories15M"]
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0))))
  checkpoint_params.save_params_dir(directory, cfg, params, tokenizer_path=tokenizer)
  return directory


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rs = np.random.RandomState(seed)
  return [[1] + rs.randint(3, vocab, rs.randint(15, 64)).tolist() for _ in range(n)]


def sequential(checkpoint_dir: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
  sampler, _ = load_sampler(checkpoint_dir)
  for bucket in (16, 32, 64):  # compile every prompt bucket first, as the server's warm-up does
    sampler.generate([[1] * (bucket - 1)], max_tokens, chunk=4, on_tokens=lambda *_: None)
  first_token = []
  start = time.perf_counter()
  generated = 0
  for ids in prompt_ids:
    sent = time.perf_counter()
    seen = []

    def on_tokens(tokens, done, sent=sent, seen=seen):
      if not seen:
        seen.append(time.perf_counter() - sent)

    generated += len(sampler.generate([ids], max_tokens, chunk=4, on_tokens=on_tokens)[0])
    first_token.append(seen[0])
  seconds = time.perf_counter() - start
  return dict(tokens=generated, seconds=seconds, tokens_per_s=generated / seconds, ttft=first_token)


def start_server(checkpoint_dir: str, port: int, slots: int, max_len: int, steps_per_call: int) -> subprocess.Popen:
  command = [
    sys.executable,
    "-m",
    "llama_jax.serve",
    "--checkpoint",
    checkpoint_dir,
    "--port",
    str(port),
    "--slots",
    str(slots),
    "--max_len",
    str(max_len),
    "--model_name",
    "bench",
    "--steps_per_call",
    str(steps_per_call),
  ]
  server = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    try:
      if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
        return server
    except httpx.HTTPError:
      time.sleep(0.2)
  server.kill()
  raise RuntimeError("the server did not start")


_local = threading.local()


def one_request(url: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
  """(seconds to the first streamed text, tokens generated) of one greedy streamed completion, through httpx."""
  sent = time.perf_counter()
  first, tokens = None, 0
  if not hasattr(_local, "http"):  # one kept-alive connection per client thread, as a real client holds
    _local.http = httpx.Client(timeout=600)
  body = load.completion_body("bench", ids, max_tokens, True)
  with _local.http.stream("POST", f"{url}/v1/completions", json=body) as response:
    response.raise_for_status()
    for line in response.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if first is None and event["choices"] and event["choices"][0]["text"]:
        first = time.perf_counter() - sent
      if event.get("usage"):
        tokens = event["usage"]["completion_tokens"]
  return (first if first is not None else time.perf_counter() - sent), tokens


def threaded_run(url: str, prompt_ids: list[list[int]], max_tokens: int, clients: int) -> list[tuple[float, int]]:
  """`clients` threads with httpx, each sending its next request when the last one has ended."""
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    return list(pool.map(lambda ids: one_request(url, ids, max_tokens), prompt_ids))


def lean_run(url: str, prompt_ids: list[list[int]], max_tokens: int, clients: int) -> list[tuple[float, int]]:
  """`clients` closed-loop clients on one asyncio thread (bench/load.py)."""
  replies = load.closed_loop(int(url.rsplit(":", 1)[1]), prompt_ids, "bench", max_tokens, clients)
  return [(r.first_text_s, r.completion_tokens) for r in replies]


CLIENTS = {"lean": lean_run, "httpx": threaded_run}


def process_cpu_s(pid: int) -> float:
  """User + system CPU seconds of a process so far (/proc)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_run(url, prompt_ids, max_tokens, clients, client="lean", server_pid=None) -> dict:
  start, own = time.perf_counter(), sum(os.times()[:2])
  served = process_cpu_s(server_pid) if server_pid else 0.0
  results = CLIENTS[client](url, prompt_ids, max_tokens, clients)
  seconds = time.perf_counter() - start
  generated = sum(tokens for _, tokens in results)
  return dict(
    tokens=generated,
    seconds=seconds,
    tokens_per_s=generated / seconds,
    ttft=[t for t, _ in results],
    client_cpu_s=sum(os.times()[:2]) - own,
    server_cpu_s=(process_cpu_s(server_pid) - served) if server_pid else None,
  )


def percentile(values: list[float], q: float) -> float:
  return float(np.percentile(values, q))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--clients", default="1,4,16")
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--max_tokens", type=int, default=64)
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--steps_per_call", type=int, default=STEPS_PER_CALL)
  parser.add_argument("--tokenizer", default=META_TOKENIZER, help="a 32000-token sentencepiece model")
  parser.add_argument("--port", type=int, default=8765)
  parser.add_argument(
    "--client",
    choices=sorted(CLIENTS),
    default="lean",
    help="load generator: one asyncio thread parsing only what it measures (default), or threads with httpx",
  )
  parser.add_argument("--json")
  args = parser.parse_args()
  if not os.path.isfile(args.tokenizer):
    sys.exit(f"error: tokenizer {args.tokenizer!r} not found; pass --tokenizer with a 32000-token .model file")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  with tempfile.TemporaryDirectory() as scratch:
    checkpoint_dir = make_checkpoint(os.path.join(scratch, "stories15M"), args.tokenizer)
    prompt_ids = prompts(args.requests, SHAPES["stories15M"].vocab_size)
    baseline = sequential(checkpoint_dir, prompt_ids, args.max_tokens)
    server = start_server(checkpoint_dir, args.port, args.slots, 64 + args.max_tokens, args.steps_per_call)
    url = f"http://127.0.0.1:{args.port}"
    try:
      # Warm-up: every prompt bucket compiled once.
      concurrent_run(url, [[1] * 15, [1] * 31, [1] * 63] * 2, args.max_tokens, 6, args.client)
      rows = {
        c: concurrent_run(url, prompt_ids, args.max_tokens, c, args.client, server.pid)
        for c in map(int, args.clients.split(","))
      }
    finally:
      server.terminate()
      server.wait(30)
  print(
    f"CPU: {cpu_name()} ({os.cpu_count()} cores); stories15M float32 random weights; {args.requests} requests of "
    f"{args.max_tokens} new tokens; server --slots {args.slots} --steps_per_call {args.steps_per_call}; "
    f"client {args.client}"
  )
  print("| clients | tokens/s | vs sequential | TTFT p50 (ms) | TTFT p95 (ms) | tokens | CPU s: clients / server |")
  print("|---|---|---|---|---|---|---|")
  b = baseline
  print(
    f"| sequential (Sampler) | {b['tokens_per_s']:.0f} | 1.00× | {percentile(b['ttft'], 50) * 1e3:.0f} | "
    f"{percentile(b['ttft'], 95) * 1e3:.0f} | {b['tokens']} | |"
  )
  for clients, r in rows.items():
    print(
      f"| {clients} | {r['tokens_per_s']:.0f} | **{r['tokens_per_s'] / b['tokens_per_s']:.2f}×** | "
      f"{percentile(r['ttft'], 50) * 1e3:.0f} | {percentile(r['ttft'], 95) * 1e3:.0f} | {r['tokens']} | "
      f"{r['client_cpu_s']:.2f} / {r['server_cpu_s']:.2f} |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"cpu": cpu_name(), "sequential": baseline, "clients": rows}, f, indent=1)


if __name__ == "__main__":
  main()
