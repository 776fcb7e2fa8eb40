"""Accelerator figures: training MFU of a ~1B LLaMA and decode speed of a 7B-shaped one, bfloat16, random weights.

    python bench/gpu.py [--json F]      # on a GPU (or TPU) host: the measurement, a few minutes
    python bench/gpu.py --smoke         # toy shapes on any backend, to check the script end to end

Training: the real ``Trainer.train_step`` (bfloat16 compute, float32 parameters and AdamW moments, state donated) of
a TinyLlama-1.1B-shaped model at 2048 tokens per sequence, one device; MFU = model FLOPs per token (``flops.
flops_per_token``) × tokens/s ÷ the device's dense bf16 peak (``flops.PEAK_FLOPS_BY_DEVICE_KIND``). Target ≥ 55%.

Decoding: the library's ``Sampler`` (jitted prefill + one while_loop, per-layer KV cache) on a LLaMA-2-7B-shaped model
stored in bfloat16, greedy, 16-token prompts, at batch 1 and 32. The batch-1 bound is the device's measured copy
bandwidth ÷ the bytes one step reads (every matrix, plus the filled cache); target ≥ 80% of it.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import median_seconds

from llama_jax.core import model_config as model_config_lib
from llama_jax.core import run_config as run_config_lib
from llama_jax.inference.sampler import Sampler
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.training import flops
from llama_jax.training import trainer as train

# TinyLlama 1.1B: 22 layers, GQA 32/4 heads, MLP 5632.
TRAIN_1B = dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden_dim=5632)
DECODE_7B = dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, multiple_of=256)
SMOKE_TRAIN = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128)
SMOKE_DECODE = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, multiple_of=32)


def copy_bandwidth(n_bytes: int) -> float:
  """Bytes/s a device-side copy moves (read + write): the ceiling for streaming weights."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 0)
  seconds = median_seconds(lambda: copy(x).block_until_ready(), warmup=2, repeats=5)
  return 2 * n_bytes / seconds


def bench_train(model: dict, batch: int, seq_len: int, remat: str, steps: int) -> dict:
  run_config = run_config_lib.base_run_config()
  run_config.model.update(**model, dtype="bfloat16", param_dtype="float32", max_seq_len=seq_len, remat=remat)
  run_config.train.update(batch_size=batch, seq_len=seq_len, steps=1000, warmup_steps=10)
  model_cfg = model_config_lib.model_config_from(run_config)
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  trainer = train.Trainer(model_cfg, run_config, mesh)
  state = trainer.init_state()
  tokens = np.random.RandomState(0).randint(0, model_cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
  data = trainer.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})

  def step():
    nonlocal state
    state, metrics = trainer.train_step(state, data)
    jax.block_until_ready(metrics)

  start = time.perf_counter()
  step()
  compile_s = time.perf_counter() - start
  seconds = median_seconds(step, warmup=2, repeats=steps)
  tokens_per_s = batch * seq_len / seconds
  peak = flops.peak_flops_per_device(0.0)
  return dict(
    params=model_cfg.num_params(),
    batch=batch,
    seq_len=seq_len,
    remat=remat,
    attention=model_cfg.attention,
    step_s=seconds,
    tokens_per_s=tokens_per_s,
    compile_s=compile_s,
    mfu=flops.flops_per_token(model_cfg, seq_len) * tokens_per_s / peak,
    peak_flops=peak,
  )


def bench_decode(model: dict, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
  cfg = model_config_lib.ModelConfig(**model, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=2048)
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  params = nnx.to_pure_dict(nnx.state(sharding.init_model(Llama, cfg, mesh, run_config_lib.DEFAULT_LOGICAL_AXIS_RULES)))
  sampler = Sampler(cfg, params, eos_id=-1)
  del params
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(sampler.params)) - cfg.vocab_size * cfg.dim * 2  # one row
  bandwidth = copy_bandwidth(min(2**32, 4 * weight_bytes))  # 4 GiB: a 1 GiB copy read 30% low on an H200
  rows = []
  for batch in batches:
    prompts = np.random.RandomState(batch).randint(3, cfg.vocab_size, (batch, 16)).tolist()
    start = time.perf_counter()
    sampler.generate(prompts, new_tokens)
    first_s = time.perf_counter() - start
    seconds = median_seconds(lambda prompts=prompts: sampler.generate(prompts, new_tokens), warmup=0, repeats=repeats)
    # A step reads the weights once and the filled part of the cache (on average half of it) per row.
    cache_bytes = 2 * cfg.n_layers * batch * (16 + new_tokens / 2) * cfg.n_kv_heads * cfg.head_dim * 2
    # Copy bandwidth counts bytes read and written: the memory's throughput, which a step spends on reads alone.
    bound = bandwidth / (weight_bytes + cache_bytes)
    tokens_per_s = batch * new_tokens / seconds
    rows.append(
      dict(
        batch=batch,
        tokens_per_s=tokens_per_s,
        steps_per_s=new_tokens / seconds,
        bound_steps_per_s=bound,
        of_bound=new_tokens / seconds / bound,
        first_call_s=first_s,
        weight_bytes=weight_bytes,
        copy_bandwidth=bandwidth,
      )
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="toy shapes, to check the script on any backend")
  parser.add_argument("--train_batch", type=int, default=16, help="sequences per training step")
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--remat", default="dots_no_batch", help="remat policy of the training run")
  parser.add_argument("--decode_batches", default="1,32")
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--parts", default="train,decode", help="which measurements: train, decode or both")
  parser.add_argument("--json", help="write the results here too")
  args = parser.parse_args()

  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  parts = args.parts.split(",")
  training, decoding = None, []
  if args.smoke:
    training = bench_train(SMOKE_TRAIN, batch=2, seq_len=128, remat=args.remat, steps=2) if "train" in parts else None
    decoding = bench_decode(SMOKE_DECODE, [1, 2], new_tokens=8, repeats=2) if "decode" in parts else []
  else:
    if "train" in parts:
      training = bench_train(TRAIN_1B, args.train_batch, args.seq_len, args.remat, steps=args.repeats)
    if "decode" in parts:
      batches = [int(b) for b in args.decode_batches.split(",")]
      decoding = bench_decode(DECODE_7B, batches, args.new_tokens, args.repeats)
  if training is not None:
    print(
      f"train: {training['params']:,} params, {training['batch']} × {training['seq_len']} tokens, "
      f"remat {training['remat']}: {training['tokens_per_s']:,.0f} tokens/s, step {training['step_s'] * 1e3:.0f} ms, "
      f"MFU {training['mfu']:.1%} of {training['peak_flops'] / 1e9:,.0f} GFLOP/s "
      f"(compile {training['compile_s']:.0f} s)"
    )
  for row in decoding:
    print(
      f"decode batch {row['batch']}: {row['tokens_per_s']:,.1f} tokens/s ({row['steps_per_s']:.1f} steps/s, "
      f"{row['of_bound']:.0%} of the {row['bound_steps_per_s']:.0f} steps/s bandwidth bound; first call "
      f"{row['first_call_s']:.1f} s)"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=device.device_kind, train=training, decode=decoding), f, indent=2)


if __name__ == "__main__":
  main()
