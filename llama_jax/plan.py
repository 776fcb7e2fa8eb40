"""Ahead-of-time memory plan of a training run: compile the real train step for a mesh of N simulated devices.

    python -m llama_jax.plan --config configs/tpu_v4.py --devices 16 [--hbm_gib 32] [--config.a.b=v]

Nothing is allocated: the state and batch are abstract (shapes, dtypes and shardings), the step is lowered and
compiled by XLA's CPU backend for `--devices` CPU devices, and the compiled memory analysis gives per-device bytes.
Those are the CPU compiler's figures: a TPU or GPU compiler fuses and schedules differently, so temporaries are an
estimate (parameter and optimizer bytes are exact). Attention kernels that exist only on accelerators (splash,
cudnn) are modelled by the "chunked" XLA attention, whose memory (rematerialised from 2048 tokens) also grows with
T·chunk rather than T².
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import jax

from llama_jax import attention as attention_lib
from llama_jax import sharding
from llama_jax.cli import parse_flags_or_exit, run_config_from_flag_or_exit
from llama_jax.config import RunConfig, run_config_from
from llama_jax.errors import exit_with_error, run_or_exit
from llama_jax.flops import flops_per_token
from llama_jax.train import Trainer

GIB = 2**30
# HBM per chip / GPU, GiB.
HBM_GIB = {"TPU v4": 32, "TPU v5e": 16, "TPU v5p": 95, "H100": 80, "H200": 141}


@dataclasses.dataclass
class Plan:
  """Per-device bytes of one compiled train step, and what produced them."""

  mesh: dict[str, int]
  devices: int
  n_params: int
  attention: str
  params_bytes: int  # from the shardings: every parameter's shard, summed
  opt_state_bytes: int
  batch_bytes: int
  argument_bytes: int  # from XLA's memory analysis of the compiled step (state + batch, donated)
  output_bytes: int
  alias_bytes: int  # outputs written in place of donated arguments
  temp_bytes: int  # activations, gradients and scratch alive during the step
  model_flops: float  # per step, all devices: 6·matmul params·tokens + attention (no remat recomputation)
  seconds: float

  @property
  def peak_bytes(self) -> int:
    """Arguments, plus outputs not written in place, plus temporaries: what must fit in one device's memory."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def fits(self, hbm_gib: float) -> bool:
    return self.peak_bytes <= hbm_gib * GIB


def _device_bytes(abstract_tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard of each array)."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard_shape) * leaf.dtype.itemsize
  return total


def model_config_for_plan(model_cfg, backend: str, seq_len: int):
  """The model as it will be compiled here: accelerator-only attention kernels are modelled by "chunked" (the XLA
  kernel where the sequence is too short to chunk)."""
  if backend == "cpu" and model_cfg.attention in ("auto", "splash", "cudnn"):
    return model_cfg.replace(attention="chunked" if attention_lib.chunk_size(seq_len) else "xla")
  return model_cfg


def plan(run_config: RunConfig, devices=None) -> Plan:
  """Compiles the train step of `run_config` over `devices` (default: all) without allocating the state."""
  start = time.perf_counter()
  run_config = run_config_from(run_config)
  devices = list(jax.devices() if devices is None else devices)
  train_cfg = run_config.train
  model_cfg = model_config_for_plan(run_config.model, jax.default_backend(), train_cfg.seq_len)
  mesh = sharding.make_mesh(run_config.mesh, devices)
  trainer = Trainer(model_cfg, run_config, mesh)
  state, batch = trainer.abstract_state(), trainer.abstract_batch()
  compiled = trainer.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  attention = attention_lib.choose_implementation(
    model_cfg.attention,
    jax.default_backend(),
    q_len=train_cfg.seq_len,
    kv_len=train_cfg.seq_len,
    head_dim=model_cfg.head_dim,
    dtype=model_cfg.dtype,
    has_segment_ids=run_config.data.format == "chat",
    has_positions=False,
  )
  return Plan(
    mesh=dict(mesh.shape),
    devices=len(devices),
    n_params=model_cfg.num_params(),
    attention=attention,
    params_bytes=_device_bytes(state["params"]),
    opt_state_bytes=_device_bytes(state["opt_state"]),
    batch_bytes=_device_bytes(batch),
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    model_flops=flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.batch_size * train_cfg.seq_len,
    seconds=time.perf_counter() - start,
  )


def report(p: Plan, run_config: RunConfig, hbm_gib: float | None = None) -> str:
  train_cfg, model = run_config.train, run_config.model
  mesh = " × ".join(f"{axis} {size}" for axis, size in p.mesh.items())
  unit, scale = ("GiB", GIB) if p.peak_bytes >= GIB else ("MiB", 2**20)
  lines = [
    f"model     {p.n_params:,} parameters ({model.param_dtype} storage, {model.dtype} compute), remat "
    f"{model.remat}, attention {p.attention}",
    f"mesh      {mesh} = {p.devices} devices",
    f"batch     {train_cfg.batch_size} × {train_cfg.seq_len} tokens, grad_accum {train_cfg.grad_accum}",
    f"per device ({unit}):",
    f"  parameters        {p.params_bytes / scale:9.3f}",
    f"  optimizer state   {p.opt_state_bytes / scale:9.3f}",
    f"  batch             {p.batch_bytes / scale:9.3f}",
    f"  arguments         {p.argument_bytes / scale:9.3f}   (compiled: state + batch)",
    f"  temporaries       {p.temp_bytes / scale:9.3f}   (compiled: activations, gradients, scratch)",
    f"  outputs not donated {(p.output_bytes - p.alias_bytes) / scale:7.3f}",
    f"  peak              {p.peak_bytes / scale:9.3f}",
    f"model FLOPs per step {p.model_flops:.3e} ({p.model_flops / p.devices:.3e} per device; remat recomputation "
    f"not counted)",
  ]
  targets = dict(HBM_GIB)
  if hbm_gib:
    targets[f"--hbm_gib {hbm_gib:g}"] = hbm_gib
  for name, gib in targets.items():
    verdict = "fits" if p.fits(gib) else "does not fit"
    lines.append(f"  {name:<14} {gib:>6g} GiB: {verdict} ({gib - p.peak_bytes / GIB:+.2f} GiB to spare)")
  lines.append(f"planned in {p.seconds:.1f} s (XLA:CPU estimate; accelerator compilers differ in temporaries)")
  return "\n".join(lines)


def main(argv=None) -> None:
  from absl import app, flags
  from ml_collections import config_flags

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tpu_v4.py")
  devices_flag = flags.DEFINE_integer("devices", None, "simulated devices (the chips or GPUs of the target)")
  hbm_flag = flags.DEFINE_float("hbm_gib", None, "also check against this much memory per device (GiB)")
  json_flag = flags.DEFINE_string("json", None, "also write the plan as JSON to this file")
  flags.mark_flags_as_required(["config", "devices"])

  def run(_):
    if devices_flag.value < 1:
      exit_with_error(f"--devices must be a positive integer, got {devices_flag.value}")
    if hbm_flag.value is not None and hbm_flag.value <= 0:
      exit_with_error(f"--hbm_gib must be > 0, got {hbm_flag.value}")
    # Simulated CPU devices: set before the first device query initialises the backend.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices_flag.value)
    run_config = run_config_from_flag_or_exit(config_flag)
    result = run_or_exit(plan, run_config)
    print(report(result, run_config, hbm_flag.value))
    if json_flag.value:
      with open(json_flag.value, "w") as f:
        json.dump({**dataclasses.asdict(result), "peak_bytes": result.peak_bytes}, f, indent=2)

  app.run(run, argv, flags_parser=parse_flags_or_exit)


if __name__ == "__main__":
  main()
