"""Decode speed: llama_jax's compiled sampler against transformers' generate, same shapes, same weights, same run.

    python bench/decode.py [--shapes stories15M,gqa] [--dtypes float32,bfloat16,int8] [--batches 1,8]
        [--new_tokens 256] [--repeats 5] [--sharded] [--json F]

Greedy decoding of random-weight models from a 16-token prompt. llama_jax: one jitted prefill and one jitted
while_loop (compile time reported apart, from the first call), weights cast (`--dtype`) or quantized
(`--quantize int8`: int8 weights, float32 scale per output channel) as the sampler does it. transformers:
`generate(do_sample=False, use_cache=True)`, torch on 2 threads, the model cast to bfloat16 or, for int8, torch's
dynamic int8 quantization of every nn.Linear (int8 weights, int8 activations, per-tensor scales; the embedding
stays float). Tokens/s counts new tokens of all rows; each figure is the median of `--repeats` runs after a warm-up.

Where a step's time goes: `step` is the measured time per loop iteration (1 / the llama_jax rate, × batch); `products`
is the same step's matrix products alone (every projection and the LM head, same dtypes and dequantization, chained
in one jitted loop); `rest` the difference (attention over the cache, norms, RoPE, cache writes, sampling, loop);
`read` the time to read the weights a step reads once: exactly those arrays' bytes summed by torch (the fastest reader
on the machine), repeated back to back like the decode loop reads them (so a model that fits in the last-level cache
is read from there). `--sharded` adds one row, gqa on 8 simulated devices (tensor=8, a subprocess): it shows the
sharded program runs; its speed on one CPU is not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from timing import median_seconds

from llama_jax.core.model_config import ModelConfig
from llama_jax.inference import placement as inference
from llama_jax.inference.sampler import Sampler
from llama_jax.interop import hf
from llama_jax.interop import hf_config as hf_config_lib
from llama_jax.model.llama import Llama

SHAPES = {
  "stories15M": ModelConfig(
    vocab_size=32000, dim=288, n_layers=6, n_heads=6, n_kv_heads=6, multiple_of=32, max_seq_len=512, tie_embeddings=True
  ),
  "gqa": ModelConfig(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256, max_seq_len=1024),
}
PROMPT_LEN = 16
PRODUCT_ROUNDS = 20  # passes over a step's products per timed call


def copy_bandwidth(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
  """Bytes/s moved by a large array copy (read + write): DRAM bandwidth, for comparison with `read_seconds`."""
  src = np.ones(n_bytes // 4, np.float32)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  return 2 * n_bytes / best


def step_weights(params: dict, cfg: ModelConfig) -> list[jax.Array]:
  """The arrays a decode step reads in full: every layer's weights and scales, the final norm and the LM head (the
  embedding table only when it is the tied head; otherwise one row per token)."""
  arrays = jax.tree.leaves(params["layers"]) + jax.tree.leaves(params["final_norm"])
  head = ("embed", "embed_scale") if cfg.tie_embeddings else ("lm_head", "lm_head_scale")
  return arrays + [params[name] for name in head if name in params]


def read_seconds(arrays: list[jax.Array], repeats: int) -> float:
  """Seconds to read `arrays` once, at their own sizes: their bytes (viewed as float32) summed by torch on the
  bench's threads, back to back, best of `repeats` × 5 passes. torch's reduction is the fastest reader measured
  here (20 GB/s from DRAM against 12 for XLA:CPU's own reduction and 9 for numpy, 2 threads); passes run back to
  back like the decode loop's, so arrays that fit in the last-level cache are read from it."""
  views = [torch.from_numpy(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.float32)) for a in arrays]
  for _ in range(3):
    for view in views:
      view.sum()
  best = float("inf")
  for _ in range(repeats * 5):
    start = time.perf_counter()
    for view in views:
      view.sum()
    best = min(best, time.perf_counter() - start)
  return best


def products_seconds(params: dict, cfg: ModelConfig, batch: int, repeats: int) -> float:
  """Seconds for one decode step's matrix products alone (batch rows, the model's dtypes and int8 dequantization,
  `model.project`), each product's input depending on the previous product's output."""
  from llama_jax.model.llama import project

  dtype = jnp.dtype(cfg.dtype)

  def scale_of(tree, name):
    return tree.get(name + "_scale")

  @jax.jit
  def run(x, params):
    def one_pass(_, x_BD):
      for layer in params["layers"].values():
        attn, mlp = layer["attention"], layer["mlp"]
        q = project(x_BD, attn["wq"], scale_of(attn, "wq"))
        k = project(x_BD, attn["wk"], scale_of(attn, "wk"))
        v = project(x_BD, attn["wv"], scale_of(attn, "wv"))
        heads = (q.sum((-1, -2)) + k.sum((-1, -2)) + v.sum((-1, -2)))[:, None, None] * 1e-6 + q
        out = project(heads.reshape(batch, -1), attn["wo"].reshape(-1, cfg.dim), scale_of(attn, "wo"))
        gate = project(x_BD + out, mlp["w_gate"], scale_of(mlp, "w_gate"))
        up = project(x_BD + out, mlp["w_up"], scale_of(mlp, "w_up"))
        x_BD = x_BD + project(gate * up, mlp["w_down"], scale_of(mlp, "w_down")) * 1e-3
      if cfg.tie_embeddings:
        logits = project(x_BD, params["embed"].T, scale_of(params, "embed"), preferred_element_type=jnp.float32)
      else:
        logits = project(x_BD, params["lm_head"], scale_of(params, "lm_head"), preferred_element_type=jnp.float32)
      return x_BD + logits.mean(-1, keepdims=True).astype(dtype) * 1e-6

    return jax.lax.fori_loop(0, PRODUCT_ROUNDS, one_pass, x)

  x = jnp.ones((batch, cfg.dim), dtype)
  run(x, params).block_until_ready()
  return median_seconds(lambda: run(x, params).block_until_ready(), repeats) / PRODUCT_ROUNDS


def hf_reference(cfg: ModelConfig, params: dict, dtype: str):
  hf_model = transformers.LlamaForCausalLM(
    transformers.LlamaConfig.from_dict(hf_config_lib.hf_config_from_model_config(cfg))
  ).eval()
  hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.hf_from_params(params, cfg).items()}, strict=False)
  hf_model.generation_config.eos_token_id = None
  if dtype == "bfloat16":
    hf_model = hf_model.to(torch.bfloat16)
  elif dtype == "int8":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # torch marks its quantized tensors deprecated; they still run
      hf_model = torch.ao.quantization.quantize_dynamic(hf_model, {torch.nn.Linear}, dtype=torch.qint8)
  return hf_model


def bench_shape(
  name: str, cfg: ModelConfig, dtypes: list[str], batches: list[int], new_tokens: int, repeats: int
) -> list[dict]:
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))))
  rows = []
  for dtype in dtypes:
    quantize = "int8" if dtype == "int8" else "none"
    sampler = Sampler(cfg, params, eos_id=-1, dtype=None if dtype == "int8" else dtype, quantize=quantize)
    hf_model = hf_reference(cfg, params, dtype)
    weights = step_weights(sampler.params, sampler.cfg)
    read = read_seconds(weights, repeats)
    step_bytes = sum(a.nbytes for a in weights)
    for batch in batches:
      prompts = np.random.RandomState(batch).randint(3, cfg.vocab_size, (batch, PROMPT_LEN))

      def generate(prompts=prompts, sampler=sampler):
        sampler.generate(prompts.tolist(), new_tokens)

      start = time.perf_counter()
      generate()
      first = time.perf_counter() - start
      jax_time = median_seconds(generate, repeats)
      inputs = torch.tensor(prompts)

      def hf_generate(inputs=inputs, hf_model=hf_model):
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
      step = jax_time / new_tokens
      products = products_seconds(sampler.params, sampler.cfg, batch, repeats)
      rows.append(
        dict(
          shape=name,
          dtype=dtype,
          batch=batch,
          new_tokens=new_tokens,
          jax_tokens_per_s=batch * new_tokens / jax_time,
          hf_tokens_per_s=batch * new_tokens / hf_time,
          ratio=hf_time / jax_time,
          compile_s=first - jax_time,
          step_mb=step_bytes / 1e6,
          step_ms=step * 1e3,
          products_ms=products * 1e3,
          rest_ms=(step - products) * 1e3,
          read_ms=read * 1e3,
          read_gb_per_s=step_bytes / read / 1e9,
          read_bound_tokens_per_s=batch / read,
        )
      )
  return rows


def sharded_row(shape: str, new_tokens: int, repeats: int) -> dict:
  """One llama_jax row on 8 simulated devices (tensor=8), run in a subprocess that has them."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  code = (
    "import sys, json; sys.path.insert(0, 'bench'); import decode; "
    f"print(json.dumps(decode.sharded_child({shape!r}, {new_tokens}, {repeats})))"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def sharded_child(shape: str, new_tokens: int, repeats: int) -> dict:
  cfg = SHAPES[shape]
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))))
  mesh = inference.decode_mesh("tensor=-1")
  sampler = Sampler(cfg, params, eos_id=-1, mesh=mesh)
  reference = Sampler(cfg, params, eos_id=-1)
  prompts = np.random.RandomState(1).randint(3, cfg.vocab_size, (1, PROMPT_LEN)).tolist()
  same = sampler.generate(prompts, new_tokens) == reference.generate(prompts, new_tokens)
  seconds = median_seconds(lambda: sampler.generate(prompts, new_tokens), repeats)
  return dict(
    shape=shape,
    mesh=dict(mesh.shape),
    tokens_per_s=new_tokens / seconds,
    same_tokens_as_one_device=same,
    weight_mb_per_device=sampler.weight_bytes_per_device() / 1e6,
    weight_mb_one_device=reference.weight_bytes_per_device() / 1e6,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="stories15M,gqa")
  parser.add_argument("--dtypes", default="float32,bfloat16,int8")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--threads", type=int, default=2, help="torch threads")
  parser.add_argument("--sharded", action="store_true", help="add a row on 8 simulated devices (tensor=8)")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  bandwidth = copy_bandwidth()
  rows = []
  for name in args.shapes.split(","):
    batches = [int(b) for b in args.batches.split(",")]
    rows += bench_shape(name, SHAPES[name], args.dtypes.split(","), batches, args.new_tokens, args.repeats)
  print(
    f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
    f"DRAM copy bandwidth (512 MiB) {bandwidth / 1e9:.1f} GB/s"
  )
  print(
    "| shape | weights | batch | llama_jax tok/s | transformers tok/s | ratio | compile s | step ms | products ms | "
    "rest ms | weights/step MB | read once ms (GB/s) | read bound tok/s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['jax_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | "
      f"{r['ratio']:.2f}× | {r['compile_s']:.1f} | {r['step_ms']:.2f} | {r['products_ms']:.2f} | "
      f"{r['rest_ms']:.2f} | {r['step_mb']:.1f} | {r['read_ms']:.2f} ({r['read_gb_per_s']:.1f}) | "
      f"{r['read_bound_tokens_per_s']:.0f} |"
    )
  sharded = None
  if args.sharded:
    sharded = sharded_row("gqa", args.new_tokens, args.repeats)  # 8 heads: tensor=8 (4 kv heads, each repeated 2×)
    print(
      f"sharded: {sharded['shape']} on mesh {sharded['mesh']} of simulated CPU devices: "
      f"{sharded['tokens_per_s']:.0f} tok/s at batch 1 (not a speed: 8 devices share this CPU), same tokens as one "
      f"device: {sharded['same_tokens_as_one_device']}, weights per device {sharded['weight_mb_per_device']:.1f} MB "
      f"of {sharded['weight_mb_one_device']:.1f}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(bandwidth_bytes_per_s=bandwidth, rows=rows, sharded=sharded), f, indent=2)


if __name__ == "__main__":
  main()
