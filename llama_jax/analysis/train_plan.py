"""Ahead-of-time plan of a training run: compile the real train step for a mesh, allocate nothing, report memory
and collectives per device (``python -m llama_jax.plan`` is the command; decode_plan.py plans decoding).

The state and batch are abstract (shapes, dtypes and shardings), the step is lowered and compiled, and the compiled
program's memory analysis gives per-device bytes; its HLO gives the collectives per step (``hlo.summarize``).

On simulated CPU devices temporaries are an estimate and accelerator-only attention kernels are modelled by the
"chunked" XLA attention (`model_config_for_plan`); on abstract TPU devices (tpu.py) every figure is the TPU
compiler's own.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from llama_jax.analysis import hlo
from llama_jax.analysis.memory import (
  GIB,
  PlanError,
  PlanHeader,
  device_bytes,
  hbm_targets,
  model_config_for_plan,
  report_unit,
)
from llama_jax.core.run_config import RunConfig, run_config_from
from llama_jax.model import attention as attention_lib
from llama_jax.model import context as context_lib
from llama_jax.model import sharding
from llama_jax.training.flops import flops_per_token
from llama_jax.training.trainer import Trainer

__all__ = ["Plan", "PlanError", "plan", "report"]


@dataclasses.dataclass
class Plan(PlanHeader):
  """Per-device bytes of one compiled train step, and what produced them (collectives and kernels per step)."""

  attention: str
  params_bytes: int  # from the shardings: every trained parameter's shard, summed (LoRA: the adapters)
  frozen_bytes: int  # LoRA: the frozen base model's shards (0 otherwise)
  trainable_params: int
  opt_state_bytes: int
  batch_bytes: int
  argument_bytes: int  # from XLA's memory analysis of the compiled step (state + batch, donated)
  output_bytes: int
  alias_bytes: int  # outputs written in place of donated arguments
  temp_bytes: int  # activations, gradients and scratch alive during the step
  model_flops: float  # per step, all devices: 6·matmul params·tokens + attention (no remat recomputation)

  @property
  def peak_bytes(self) -> int:
    """Arguments, plus outputs not written in place, plus temporaries: what must fit in one device's memory."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def fits(self, hbm_gib: float) -> bool:
    return self.peak_bytes <= hbm_gib * GIB


def plan(run_config: RunConfig, devices=None, hlo_path: str | None = None) -> Plan:
  """Compiles the train step of `run_config` over `devices` (default: all; abstract TPU devices from `tpu_devices`
  for the TPU compiler) without allocating the state; `hlo_path` receives the compiled program's HLO text. Its
  length is the Plan it fills, field by field."""
  start = time.perf_counter()
  run_config = run_config_from(run_config)
  devices = list(jax.devices() if devices is None else devices)
  platform = devices[0].platform
  train_cfg = run_config.train
  model_cfg = model_config_for_plan(run_config.model, platform, train_cfg.seq_len)
  mesh = sharding.make_mesh(run_config.mesh, devices)
  trainer = Trainer(model_cfg, run_config, mesh)
  state, batch = trainer.abstract_state(), trainer.abstract_batch()
  lowered = trainer.lower(state, batch)
  compile_start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # The TPU compiler refuses a program that cannot fit its HBM: that is the plan's answer, in one line.
    reason = str(e).strip().splitlines()[0].split("RESOURCE_EXHAUSTED: ", 1)[-1]
    raise PlanError(
      f"does not fit: {reason} (batch {train_cfg.batch_size} × {train_cfg.seq_len} on mesh {dict(mesh.shape)}); "
      f"lower the batch or seq_len, raise remat, or use more devices"
    ) from None
  compile_seconds = time.perf_counter() - compile_start
  memory = compiled.memory_analysis()
  hlo_text = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(hlo_text)
  program = hlo.summarize(hlo_text)
  attention = attention_lib.choose_implementation(
    model_cfg.attention,
    platform,
    q_len=train_cfg.seq_len,
    kv_len=train_cfg.seq_len,
    head_dim=model_cfg.head_dim,
    dtype=model_cfg.dtype,
    has_segment_ids=run_config.data.format == "chat",
    has_positions=False,
  )
  if mesh.shape["context"] > 1:  # each device's slice of the sequence: the context strategy's per-device kernel
    kernel = context_lib.slice_kernel(
      model_cfg.attention,
      platform,
      strategy=model_cfg.context_strategy,
      seq_len=train_cfg.seq_len,
      shards=mesh.shape["context"],
      head_dim=model_cfg.head_dim,
    )
    attention = f"context {model_cfg.context_strategy} ({'splash' if kernel == 'splash' else 'xla blocks'})"
  return Plan(
    **PlanHeader.fields(
      mesh, devices, model_cfg.num_params(), program, compile_seconds, seconds=time.perf_counter() - start
    ),
    attention=attention,
    params_bytes=device_bytes(state["params"]),
    frozen_bytes=device_bytes(trainer.abstract_frozen) if trainer.abstract_frozen is not None else 0,
    trainable_params=sum(math.prod(a.shape) for a in jax.tree.leaves(state["params"])),
    opt_state_bytes=device_bytes(state["opt_state"]),
    batch_bytes=device_bytes(batch),
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    model_flops=flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.batch_size * train_cfg.seq_len,
  )


def report(p: Plan, run_config: RunConfig, hbm_gib: float | None = None) -> str:
  train_cfg, model = run_config.train, run_config.model
  unit, scale = report_unit(p.peak_bytes)
  lines = [
    f"model     {p.n_params:,} parameters ({model.param_dtype} storage, {model.dtype} compute), remat "
    f"{model.remat}, attention {p.attention}",
    *(
      [
        f"LoRA      rank {train_cfg.lora.rank}, alpha {train_cfg.lora.alpha:g} on {','.join(train_cfg.lora.targets)}: "
        f"{p.trainable_params:,} trainable (float32), the base frozen"
      ]
      if train_cfg.lora.rank
      else []
    ),
    p.mesh_line(),
    f"batch     {train_cfg.batch_size} × {train_cfg.seq_len} tokens, grad_accum {train_cfg.grad_accum}",
    f"per device ({unit}):",
    f"  parameters        {p.params_bytes / scale:9.3f}" + ("   (trained: the adapters)" if p.frozen_bytes else ""),
    *([f"  frozen base       {p.frozen_bytes / scale:9.3f}"] if p.frozen_bytes else []),
    f"  optimizer state   {p.opt_state_bytes / scale:9.3f}",
    f"  batch             {p.batch_bytes / scale:9.3f}",
    f"  arguments         {p.argument_bytes / scale:9.3f}   (compiled: state + batch)",
    f"  temporaries       {p.temp_bytes / scale:9.3f}   (compiled: activations, gradients, scratch)",
    f"  outputs not donated {(p.output_bytes - p.alias_bytes) / scale:7.3f}",
    f"  peak              {p.peak_bytes / scale:9.3f}",
    f"model FLOPs per step {p.model_flops:.3e} ({p.model_flops / p.devices:.3e} per device; remat recomputation "
    f"not counted)",
    "collectives per step and device (executions, size of the arrays they produce):",
    *p.collective_lines(),
    *p.kernel_lines("step"),
  ]
  for name, gib in hbm_targets(hbm_gib).items():
    verdict = "fits" if p.fits(gib) else "does not fit"
    lines.append(f"  {name:<14} {gib:>6g} GiB: {verdict} ({gib - p.peak_bytes / GIB:+.2f} GiB to spare)")
  lines.append(p.timing_line("accelerator compilers"))
  return "\n".join(lines)
