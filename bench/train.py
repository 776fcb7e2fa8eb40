"""Train-step throughput on CPU: llama_jax's jitted step against HF transformers LlamaForCausalLM + torch AdamW.

    python bench/train.py --shapes a,b --json bench_train.json   # the measurement (a quiet machine, minutes)
    python bench/train.py --quick                                # smoke run on toy shapes (seconds)

Both sides do the same work per step, on the same random tokens: forward, float32 cross-entropy over the whole
vocabulary, backward, global-norm clipping at 1.0, AdamW (β 0.9/0.95, decay 0.1 on matrices only). llama_jax runs
the real ``Trainer.train_step`` (jitted, state donated), once in float32 and once with bfloat16 compute over float32
parameters. HF uses ``attn_implementation="sdpa"`` (torch's fastest CPU attention) and a fused AdamW.

Throughput is tokens per step over the median step time after warm-up; each step is waited for (the torch step is
synchronous, so the JAX one is too). The JAX compile time is reported apart. MFU counts
``flops.flops_per_token`` against the best float32 matmul this machine managed, measured in both JAX and torch.

Measure on an otherwise idle machine: other load costs torch's OpenMP threads far more than XLA's thread pool (on a
busy 2-core machine a 2-thread torch matmul ran 20× slower than a 1-thread one), so a busy machine flatters JAX.
``--remat`` changes only the JAX runs, for A/B experiments on activation memory traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from timing import step_times

from llama_jax.core import model_config as model_config_lib
from llama_jax.core import run_config as run_config_lib
from llama_jax.interop import hf_config as hf_config_lib
from llama_jax.model import sharding
from llama_jax.training import flops
from llama_jax.training import trainer as train

LR, B1, B2, EPS, WEIGHT_DECAY, CLIP_NORM = 3e-4, 0.9, 0.95, 1e-8, 0.1, 1.0


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  model: dict[str, Any]  # ModelConfig fields
  batch_size: int
  seq_len: int


SHAPES = {
  # Karpathy's stories15M: hidden 768 by LLaMA's rule with multiple_of 32.
  "a": Shape(
    "stories15M",
    dict(vocab_size=32000, dim=288, n_layers=6, n_heads=6, n_kv_heads=6, multiple_of=32, tie_embeddings=True),
    batch_size=8,
    seq_len=256,
  ),
  # Grouped-query attention (2 query heads per kv head); hidden 1536 with multiple_of 256.
  "b": Shape(
    "gqa",
    dict(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256, tie_embeddings=False),
    batch_size=8,
    seq_len=512,
  ),
}
# --quick: the same structure (tied MHA / untied GQA) at toy sizes, to check the script runs end to end.
QUICK_SHAPES = {
  "a": Shape(
    "stories15M-quick",
    dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, multiple_of=32, tie_embeddings=True),
    batch_size=2,
    seq_len=32,
  ),
  "b": Shape(
    "gqa-quick",
    dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, tie_embeddings=False),
    batch_size=2,
    seq_len=64,
  ),
}


# ---------------------------------------------------------------------------------------------------------------------
# Timing


def time_steps(step: Callable[[], Any], warmup: int, steps: int) -> dict[str, Any]:
  """Runs `warmup` untimed steps, then `steps` timed ones; `step` must return only once its work is done."""
  times = step_times(step, steps, warmup)
  return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times), times_s=times)


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
  fn()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def matmul_peaks(size: int) -> dict[str, float]:
  """FLOP/s of one square matmul: float32 in JAX (the library's own measure) and torch, and bfloat16 in JAX
  (to show what bf16 compute can gain on this CPU at best)."""
  a = torch.ones(size, size)
  torch_f32 = 2 * size**3 / _best_seconds(lambda: torch.mm(a, a), repeats=5)
  b = jnp.ones((size, size), jnp.bfloat16)
  matmul = jax.jit(lambda x: x @ x)
  jax_bf16 = 2 * size**3 / _best_seconds(lambda: matmul(b).block_until_ready(), repeats=5)
  return dict(jax_f32=flops.measured_matmul_flops(size), torch_f32=torch_f32, jax_bf16=jax_bf16)


# ---------------------------------------------------------------------------------------------------------------------
# The two train steps


def make_run_config(shape: Shape, dtype: str, remat: str = "none"):
  run_config = run_config_lib.base_run_config()
  run_config.model.update(**shape.model, dtype=dtype, param_dtype="float32", max_seq_len=shape.seq_len, remat=remat)
  run_config.train.update(
    batch_size=shape.batch_size,
    seq_len=shape.seq_len,
    steps=1000,
    warmup_steps=10,
    lr=LR,
    b1=B1,
    b2=B2,
    eps=EPS,
    weight_decay=WEIGHT_DECAY,
    clip_norm=CLIP_NORM,
  )
  return run_config


def bench_jax(
  shape: Shape, dtype: str, remat: str, inputs: np.ndarray, targets: np.ndarray, warmup: int, steps: int
) -> dict[str, Any]:
  """llama_jax's Trainer.train_step on one device; compile (trace + lower + XLA compile) is timed on its own."""
  run_config = make_run_config(shape, dtype, remat)
  model_cfg = model_config_lib.model_config_from(run_config)
  # One device, like the single torch process: an XLA_FLAGS host device count must not split the batch.
  mesh = sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1), devices=jax.devices()[:1])
  trainer = train.Trainer(model_cfg, run_config, mesh)
  state = trainer.init_state()
  batch = trainer.global_batch({"inputs": inputs, "targets": targets})
  jax.block_until_ready((state, batch))

  start = time.perf_counter()
  trainer.lower(state, batch).compile()
  compile_s = time.perf_counter() - start

  losses = []

  def step():
    nonlocal state
    state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    losses.append(float(metrics["loss"]))

  start = time.perf_counter()
  step()  # first call: the jit cache should hold the executable compiled above
  first_step_s = time.perf_counter() - start
  result = time_steps(step, max(warmup - 1, 0), steps)
  return dict(result, compile_s=compile_s, first_step_s=first_step_s, first_loss=losses[0], last_loss=losses[-1])


def bench_torch(shape: Shape, inputs: np.ndarray, targets: np.ndarray, warmup: int, steps: int) -> dict[str, Any]:
  """HF LlamaForCausalLM (same hyper-parameters via convert.hf_config_from_model_config) + fused AdamW."""
  model_cfg = model_config_lib.model_config_from(make_run_config(shape, "float32"))
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig.from_dict(hf_config_lib.hf_config_from_model_config(model_cfg))
  hf_config._attn_implementation = "sdpa"
  hf_config.use_cache = False  # a training step has no use for a KV cache
  model = transformers.LlamaForCausalLM(hf_config).train()
  params = list(model.parameters())  # tied embeddings appear once
  optimizer = torch.optim.AdamW(
    [
      dict(params=[p for p in params if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
      dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0),
    ],
    lr=LR,
    betas=(B1, B2),
    eps=EPS,
    fused=True,
  )
  inputs_t, targets_t = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
  vocab = model_cfg.vocab_size
  losses = []

  def step():
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs_t).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), targets_t.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
    optimizer.step()
    losses.append(loss.item())

  result = time_steps(step, warmup, steps)
  return dict(result, first_loss=losses[0], last_loss=losses[-1])


# ---------------------------------------------------------------------------------------------------------------------
# Report


def bench_shape(shape: Shape, warmup: int, steps: int, peak: float, remat: str) -> dict[str, Any]:
  model_cfg = model_config_lib.model_config_from(make_run_config(shape, "float32"))
  rng = np.random.default_rng(0)
  window = rng.integers(0, model_cfg.vocab_size, (shape.batch_size, shape.seq_len + 1), dtype=np.int32)
  inputs, targets = window[:, :-1], window[:, 1:]
  tokens = shape.batch_size * shape.seq_len
  flops_per_token = flops.flops_per_token(model_cfg, shape.seq_len)

  runs = {}
  for name, run in (
    ("torch", lambda: bench_torch(shape, inputs, targets, warmup, steps)),
    ("jax_f32", lambda: bench_jax(shape, "float32", remat, inputs, targets, warmup, steps)),
    ("jax_bf16", lambda: bench_jax(shape, "bfloat16", remat, inputs, targets, warmup, steps)),
  ):
    result = run()
    result["tokens_per_s"] = tokens / result["median_s"]
    result["mfu"] = result["tokens_per_s"] * flops_per_token / peak
    runs[name] = result
    gc.collect()
  return dict(
    shape=shape.name,
    model=shape.model,
    hidden_dim=model_cfg.hidden_dim,
    params=model_cfg.num_params(),
    batch_size=shape.batch_size,
    seq_len=shape.seq_len,
    flops_per_token=flops_per_token,
    runs=runs,
    ratio_jax_f32=runs["jax_f32"]["tokens_per_s"] / runs["torch"]["tokens_per_s"],
    ratio_jax_bf16=runs["jax_bf16"]["tokens_per_s"] / runs["torch"]["tokens_per_s"],
  )


def markdown(results: list[dict[str, Any]], peaks: dict[str, float]) -> str:
  lines = [
    "| shape | params | B×T | torch tok/s | jax f32 tok/s | jax/torch | jax bf16 tok/s | bf16/torch "
    "| compile f32 s | compile bf16 s | MFU torch | MFU jax f32 | MFU jax bf16 |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    t, f, h = r["runs"]["torch"], r["runs"]["jax_f32"], r["runs"]["jax_bf16"]
    lines.append(
      f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['batch_size']}×{r['seq_len']} | {t['tokens_per_s']:,.0f} "
      f"| {f['tokens_per_s']:,.0f} | {r['ratio_jax_f32']:.2f} | {h['tokens_per_s']:,.0f} "
      f"| {r['ratio_jax_bf16']:.2f} | {f['compile_s']:.1f} | {h['compile_s']:.1f} | {t['mfu']:.1%} "
      f"| {f['mfu']:.1%} | {h['mfu']:.1%} |"
    )
  lines += [
    "",
    f"MFU peak: best float32 matmul = {max(peaks['jax_f32'], peaks['torch_f32']) / 1e9:.1f} GFLOP/s "
    f"(jax f32 {peaks['jax_f32'] / 1e9:.1f}, torch f32 {peaks['torch_f32'] / 1e9:.1f}; "
    f"jax bf16 {peaks['jax_bf16'] / 1e9:.1f} GFLOP/s for reference).",
    "",
    "| shape | run | median s | min s | max s | first step s | loss first → last |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in results:
    for name, run in r["runs"].items():
      first = f"{run['first_step_s']:.3f}" if "first_step_s" in run else "-"
      lines.append(
        f"| {r['shape']} | {name} | {run['median_s']:.4f} | {run['min_s']:.4f} | {run['max_s']:.4f} "
        f"| {first} | {run['first_loss']:.3f} → {run['last_loss']:.3f} |"
      )
  lines += [
    "",
    "Losses are a sanity check only (both start near ln V); llama_jax's learning rate warms up from 0 "
    "over 10 steps, torch's is constant, so the last losses differ.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="a,b", help="comma-separated keys of SHAPES: a (stories15M), b (gqa)")
  parser.add_argument("--steps", type=int, default=7, help="timed steps per run, the median is reported (use >= 5)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run before timing")
  parser.add_argument("--quick", action="store_true", help="toy shapes, 2 timed steps, 1 warm-up: a smoke test")
  parser.add_argument(
    "--torch-threads",
    type=int,
    default=len(os.sched_getaffinity(0)),
    help="torch intra-op threads (default: the cores this process may use)",
  )
  parser.add_argument("--json", default="", help="also write the results to this JSON file")
  # Experiments on the JAX side only; the defaults measure llama_jax as it is configured out of the box.
  parser.add_argument(
    "--remat", default="none", choices=model_config_lib.REMAT_POLICIES, help="llama_jax model.remat for both JAX runs"
  )
  args = parser.parse_args(argv)

  table = QUICK_SHAPES if args.quick else SHAPES
  keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
  unknown = [k for k in keys if k not in table]
  if unknown or not keys:
    parser.error(f"--shapes must list keys of {sorted(table)}, got {args.shapes!r}")
  steps, warmup = (min(args.steps, 2), min(args.warmup, 1)) if args.quick else (args.steps, args.warmup)
  if steps < 1 or warmup < 1:
    parser.error(f"--steps and --warmup must be >= 1, got {args.steps} and {args.warmup}")
  load = os.getloadavg()[0]
  if load > 0.5:
    print(
      f"warning: 1-minute load average is {load:.1f}; other processes are running and the timings (torch's above "
      "all) will not be representative",
      file=sys.stderr,
    )
  torch.set_num_threads(args.torch_threads)

  peaks = matmul_peaks(256 if args.quick else 2048)
  peak = max(peaks["jax_f32"], peaks["torch_f32"])
  results = [bench_shape(table[k], warmup, steps, peak, args.remat) for k in keys]
  print(
    f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
    f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
    f"({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
    f"median of {steps} steps after {warmup} warm-up; jax remat={args.remat}"
  )
  print()
  print(markdown(results, peaks))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        dict(
          steps=steps,
          warmup=warmup,
          remat=args.remat,
          torch_threads=torch.get_num_threads(),
          cores=len(os.sched_getaffinity(0)),
          jax=jax.__version__,
          torch=torch.__version__,
          transformers=transformers.__version__,
          peaks_flops=peaks,
          results=results,
        ),
        f,
        indent=2,
      )


if __name__ == "__main__":
  main()
