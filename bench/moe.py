"""Mixture-of-experts train-step throughput on CPU: the ways llama_jax runs the experts, side by side in one run,
against the dense reference path, a dense model of the same active parameters, and HF transformers'
MixtralForCausalLM.

    python bench/moe.py --json bench_moe.json     # the measurement (a quiet machine, minutes)
    python bench/moe.py --quick                   # smoke run on toy shapes (seconds)

The shape is configs/tiny_moe.py's (dim 128, 4 layers, 8 experts of width 176, top-2) with an untied head (as HF
Mixtral has), batch 8 × 256 tokens. Every llama_jax row is the real ``Trainer.train_step`` (forward, cross-entropy,
balance loss, backward, clipping, AdamW; jitted, state donated) on one device:
- dropless/tiles and dropless/ragged_dot: the grouped matmul by row tiles (the CPU default) and by lax.ragged_dot;
- capacity 1.25: equal-size einsums per expert, assignments past 1.25 × the fair share dropped;
- dense reference: every expert on every token (what the others are tested against);
- dense model: the SwiGLU MLP of width 352 = 2 × 176, the same active parameters per token.
HF's row is MixtralForCausalLM (its per-expert loop over the routed tokens) with the load-balancing loss
(output_router_logits) and fused AdamW, same hyper-parameters, random weights. Throughput is tokens per step over the
median step time after warm-up; compile time is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import train as train_bench  # noqa: E402  (bench/train.py)
import transformers  # noqa: E402
from timing import cpu_name, step_times  # noqa: E402

from llama_jax.core import run_config as run_config_lib  # noqa: E402
from llama_jax.interop import hf_config as hf_config_lib  # noqa: E402

MODEL = dict(
  vocab_size=4096,
  dim=128,
  n_layers=4,
  n_heads=4,
  n_kv_heads=4,
  ffn_hidden_dim=176,
  tie_embeddings=False,
)
QUICK_MODEL = dict(MODEL, dim=64, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=512)
MOE = dict(num_experts=8, top_k=2, aux_loss_weight=0.01)
VARIANTS = {
  "dropless/tiles": dict(moe=dict(MOE, compute="dropless", grouped="tiles")),
  "dropless/ragged_dot": dict(moe=dict(MOE, compute="dropless", grouped="ragged_dot")),
  "capacity 1.25": dict(moe=dict(MOE, compute="capacity", capacity_factor=1.25)),
  "dense reference": dict(moe=dict(MOE, compute="dense")),
  "dense model (width 352)": dict(ffn_hidden_dim=352, moe=dict(num_experts=0)),
}
REFERENCE = "dense reference"


def run_config(model: dict, batch_size: int, seq_len: int):
  cfg = run_config_lib.base_run_config()
  cfg.model.update(**{k: v for k, v in model.items() if k != "moe"})
  cfg.model.moe.update(**model.get("moe", {}))
  cfg.train.update(batch_size=batch_size, seq_len=seq_len, steps=1000, warmup_steps=10, lr=3e-4)
  return run_config_lib.run_config_from(cfg)


def bench_jax(model: dict, tokens: np.ndarray, warmup: int, steps: int) -> dict:
  """bench/train.py's timing of the real Trainer.train_step (float32, compile timed apart) for this model."""
  shape = train_bench.Shape(model.get("moe", {}).get("compute", "dense"), model, tokens.shape[0], tokens.shape[1] - 1)
  return train_bench.bench_jax(shape, "float32", "none", tokens[:, :-1], tokens[:, 1:], warmup, steps)


def bench_hf(model: dict, tokens: np.ndarray, warmup: int, steps: int) -> dict:
  cfg = run_config(dict(model, moe=MOE), tokens.shape[0], tokens.shape[1] - 1).model
  torch.manual_seed(0)
  hf_config = transformers.MixtralConfig.from_dict(hf_config_lib.hf_config_from_model_config(cfg))
  hf_config._attn_implementation = "sdpa"
  hf_config.use_cache = False
  hf_model = transformers.MixtralForCausalLM(hf_config).train()
  params = list(hf_model.parameters())
  optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
  inputs, labels = torch.from_numpy(tokens[:, :-1]).long(), torch.from_numpy(tokens[:, 1:]).long()
  losses = []

  def step():
    optimizer.zero_grad(set_to_none=True)
    out = hf_model(input_ids=inputs, output_router_logits=True)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size).float(), labels.reshape(-1))
    loss = loss + cfg.moe.aux_loss_weight * out.aux_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    losses.append(loss.item())

  times = step_times(step, steps, warmup)
  return dict(median_s=statistics.median(times), compile_s=0.0, last_loss=losses[-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="toy shapes, 2 steps: checks the script runs")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--json", default="", help="also write the results here")
  args = parser.parse_args(argv)
  model, batch_size, seq_len = (QUICK_MODEL, 2, 32) if args.quick else (MODEL, 8, 256)
  steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
  torch.set_num_threads(os.cpu_count() or 1)
  tokens = np.random.RandomState(0).randint(0, model["vocab_size"], (batch_size, seq_len + 1)).astype(np.int32)
  results = {}
  for name, changes in VARIANTS.items():
    results[name] = bench_jax(dict(model, **changes), tokens, warmup, steps)
    print(f"{name:<26} {batch_size * seq_len / results[name]['median_s']:>9.0f} tokens/s", flush=True)
  results["HF MixtralForCausalLM (torch)"] = bench_hf(model, tokens, warmup, steps)
  reference = results[REFERENCE]["median_s"]
  lines = ["| run | step (ms) | tokens/s | vs dense reference | compile (s) |", "|---|---|---|---|---|"]
  for name, r in results.items():
    tokens_per_s = batch_size * seq_len / r["median_s"]
    lines.append(
      f"| {name} | {r['median_s'] * 1e3:.0f} | {tokens_per_s:,.0f} | {reference / r['median_s']:.2f}× | "
      f"{r['compile_s']:.1f} |"
    )
  model_name = cpu_name()
  print("\n".join(lines))
  print(f"CPU: {model_name}, {os.cpu_count()} cores; jax {jax.__version__}, torch {torch.__version__}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(results=results, cpu=model_name, python=platform.python_version()), f, indent=2)


if __name__ == "__main__":
  main()
