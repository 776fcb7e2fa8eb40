"""The matrix products of a decode step, alone: XLA:CPU against torch, weights streamed from memory.

    python bench/matmul.py [--shapes 8x512x1536,1x288x32000] [--mbytes 96] [--repeats 7] [--json F]

Each shape MxKxN is x[M, K] · w[K, N] as a decode step runs it: a chain of products over distinct weight matrices
(together at least `--mbytes`, so they come from memory, not cache), each product's input depending on all of the
previous product's output (a product whose output went unused would be removed by XLA). llama_jax's way: one
jitted `fori_loop` over the chain (no dispatch per product); also with each weight split
into two column blocks held as separate buffers (two independent products, which XLA:CPU can run on two cores at
once). torch: `F.linear` over the same chain, 2 threads. Time per product, median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import torch
from timing import median_seconds

DEFAULT_SHAPES = "1x288x768,8x288x768,1x512x1536,8x512x1536,1x288x32000,8x288x32000"
ROUNDS = 10  # passes over the chain per timed call, so a call lasts milliseconds


def jax_chain(blocks_per_weight: list[list[jax.Array]], m: int, k: int, repeats: int) -> float:
  """Seconds per product of the chain under one jitted fori_loop."""

  @jax.jit
  def run(x, weights):
    def one_pass(_, x):
      for blocks in weights:
        y = jnp.concatenate([x @ block for block in blocks], axis=-1)
        x = x + y.sum(axis=-1, keepdims=True) * 1e-6  # the next product depends on all of this one
      return x

    return jax.lax.fori_loop(0, ROUNDS, one_pass, x)

  x = jnp.ones((m, k), jnp.float32)
  run(x, blocks_per_weight).block_until_ready()
  return median_seconds(lambda: run(x, blocks_per_weight).block_until_ready(), repeats) / (
    ROUNDS * len(blocks_per_weight)
  )


def torch_chain(weights: list[np.ndarray], m: int, k: int, repeats: int) -> float:
  linear = [torch.from_numpy(np.ascontiguousarray(w.T)) for w in weights]  # torch stores [N, K]
  x = torch.ones(m, k)

  def run():
    with torch.no_grad():
      y = x
      for _ in range(ROUNDS):
        for w in linear:
          y = y + torch.nn.functional.linear(y, w).sum(dim=-1, keepdim=True) * 1e-6
    return y

  run()
  return median_seconds(run, repeats) / (ROUNDS * len(linear))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
  parser.add_argument("--mbytes", type=float, default=96, help="total weight bytes per chain, in MB")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--threads", type=int, default=2, help="torch threads")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  rng = np.random.RandomState(0)
  rows = []
  for spec in args.shapes.split(","):
    m, k, n = (int(v) for v in spec.split("x"))
    mbytes = k * n * 4 / 1e6
    count = max(2, int(np.ceil(args.mbytes / mbytes)))
    weights = [(rng.randn(k, n) * 0.02).astype(np.float32) for _ in range(count)]
    one = jax_chain([[jnp.asarray(w)] for w in weights], m, k, args.repeats)
    halves = jax_chain(
      [[jnp.asarray(w[:, : n // 2]), jnp.asarray(w[:, n // 2 :])] for w in weights], m, k, args.repeats
    )
    ref = torch_chain(weights, m, k, args.repeats)
    rows.append(
      dict(
        shape=spec, weight_mb=mbytes, chain=count, jax_ms=one * 1e3, jax_two_blocks_ms=halves * 1e3, torch_ms=ref * 1e3
      )
    )
  print(f"jax {jax.__version__}, torch {torch.__version__} ({args.threads} threads); ms per product, GB/s of weights")
  print(
    "| M×K×N | weight MB | chain | llama_jax (XLA) ms | GB/s | two column blocks ms | GB/s | torch ms | GB/s | "
    "torch ÷ XLA |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['shape']} | {r['weight_mb']:.1f} | {r['chain']} | {r['jax_ms']:.3f} | "
      f"{r['weight_mb'] / r['jax_ms']:.1f} | {r['jax_two_blocks_ms']:.3f} | "
      f"{r['weight_mb'] / r['jax_two_blocks_ms']:.1f} | {r['torch_ms']:.3f} | {r['weight_mb'] / r['torch_ms']:.1f} | "
      f"{r['torch_ms'] / r['jax_ms']:.2f}× |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
