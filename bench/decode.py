"""Decode speed: llama_jax's compiled sampler against transformers' generate, same shapes, same run.

    python bench/decode.py [--shapes stories15M,gqa] [--batches 1,8] [--new_tokens 256] [--repeats 5] [--json F]

Greedy decoding of random-weight float32 models from a 16-token prompt. llama_jax: one jitted prefill and one
jitted while_loop (compile time reported apart, from the first call). transformers: `generate(do_sample=False,
use_cache=True)` with torch on 2 threads. Tokens/s counts new tokens of all rows; each figure is the median of
`--repeats` runs after a warm-up. The batch-1 memory-bandwidth bound is the measured copy bandwidth divided by the
bytes of weights one decode step reads.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import torch
import transformers
from flax import nnx
from timing import median_seconds

from llama_jax import convert
from llama_jax.config import ModelConfig
from llama_jax.model import Llama
from llama_jax.sample import Sampler

SHAPES = {
  "stories15M": ModelConfig(
    vocab_size=32000, dim=288, n_layers=6, n_heads=6, n_kv_heads=6, multiple_of=32, max_seq_len=512, tie_embeddings=True
  ),
  "gqa": ModelConfig(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256, max_seq_len=1024),
}
PROMPT_LEN = 16


def copy_bandwidth(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
  """Bytes/s moved by a large array copy (read + write), the ceiling for reading weights."""
  src = np.ones(n_bytes // 4, np.float32)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  return 2 * n_bytes / best


def bench_shape(name: str, cfg: ModelConfig, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))))
  hf_model = transformers.LlamaForCausalLM(
    transformers.LlamaConfig.from_dict(convert.hf_config_from_model_config(cfg))
  ).eval()
  hf_model.load_state_dict(
    {k: torch.from_numpy(v) for k, v in convert.hf_from_params(params, cfg).items()}, strict=False
  )
  hf_model.generation_config.eos_token_id = None
  sampler = Sampler(cfg, jax.device_put(params), eos_id=-1)
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  # A decode step reads every matrix once; the embedding table only one row per token, unless it is the LM head.
  step_bytes = weight_bytes - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim * 4)
  rows = []
  for batch in batches:
    prompts = np.random.RandomState(batch).randint(3, cfg.vocab_size, (batch, PROMPT_LEN))

    def generate(prompts=prompts):
      sampler.generate(prompts.tolist(), new_tokens)

    start = time.perf_counter()
    generate()
    first = time.perf_counter() - start
    jax_time = median_seconds(generate, repeats)
    inputs = torch.tensor(prompts)

    def hf_generate(inputs=inputs):
      with torch.no_grad():
        hf_model.generate(
          inputs,
          attention_mask=torch.ones_like(inputs),
          do_sample=False,
          use_cache=True,
          max_new_tokens=new_tokens,
          min_new_tokens=new_tokens,
          pad_token_id=0,
        )

    hf_generate()
    hf_time = median_seconds(hf_generate, repeats)
    rows.append(
      dict(
        shape=name,
        batch=batch,
        new_tokens=new_tokens,
        jax_tokens_per_s=batch * new_tokens / jax_time,
        hf_tokens_per_s=batch * new_tokens / hf_time,
        ratio=hf_time / jax_time,
        compile_s=first - jax_time,
        step_mb=step_bytes / 1e6,
      )
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="stories15M,gqa")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--threads", type=int, default=2, help="torch threads")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  bandwidth = copy_bandwidth()
  rows = []
  for name in args.shapes.split(","):
    rows += bench_shape(name, SHAPES[name], [int(b) for b in args.batches.split(",")], args.new_tokens, args.repeats)
  print(
    f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
    f"copy bandwidth {bandwidth / 1e9:.1f} GB/s"
  )
  print(
    "| shape | batch | llama_jax tok/s | transformers tok/s | ratio | compile s | weights read/step MB | "
    "batch-1 bound tok/s |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    r["bandwidth_bound_tokens_per_s"] = bandwidth / (r["step_mb"] * 1e6)
    print(
      f"| {r['shape']} | {r['batch']} | {r['jax_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | "
      f"{r['ratio']:.2f}× | {r['compile_s']:.1f} | {r['step_mb']:.1f} | {r['bandwidth_bound_tokens_per_s']:.0f} |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(bandwidth_bytes_per_s=bandwidth, rows=rows), f, indent=2)


if __name__ == "__main__":
  main()
