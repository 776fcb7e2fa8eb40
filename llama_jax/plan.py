"""Ahead-of-time plan of a training run: compile the real train step for a mesh, allocate nothing, report memory
and collectives per device.

    python -m llama_jax.plan --config configs/tpu_v4.py --devices 16 [--hbm_gib 32] [--config.a.b=v]
    python -m llama_jax.plan --config configs/tpu_v4.py --topology v4-32 [--slices N] [--json F]
    python -m llama_jax.plan --decode --config configs/llama2_7b.py --devices 1 --batch 8 --max_len 4096 [...]

With ``--decode`` the plan is of decoding instead (the Sampler's prefill and decode loop; see ``plan_decode``).

The state and batch are abstract (shapes, dtypes and shardings), the step is lowered and compiled, and the compiled
program's memory analysis gives per-device bytes; its HLO gives the collectives per step (``hlo.summarize``).

- ``--devices N``: XLA's CPU compiler for N simulated CPU devices. Temporaries are an estimate (a TPU or GPU compiler
  fuses and schedules differently; parameter and optimizer bytes are exact), and attention kernels that exist only
  on accelerators (splash, cudnn) are modelled by the "chunked" XLA attention.
- ``--topology v4-32``: the real TPU compiler (libtpu, the ``tpu-aot`` extra) for that slice's abstract TPU devices,
  on any host and with no TPU: the TPU kernels (splash attention) are in the program, and memory, collectives and
  fusion are the TPU compiler's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import jax

from llama_jax import attention as attention_lib
from llama_jax import hlo, sharding
from llama_jax.cli import parse_flags_or_exit, run_config_from_flag_or_exit
from llama_jax.config import RunConfig, run_config_from
from llama_jax.errors import LlamaJaxError, exit_with_error, run_or_exit
from llama_jax.flops import flops_per_token
from llama_jax.train import Trainer

GIB = 2**30
# HBM per chip / GPU, GiB.
HBM_GIB = {"TPU v4": 32, "TPU v5e": 16, "TPU v5p": 95, "TPU v6e": 32, "H100": 80, "H200": 141}
# Cloud TPU slice names → (topology for the TPU compiler, chip config, chips per host). v4 and v5p names count
# TensorCores (two per chip, "megacore"): v4-32 is 16 chips; v5e and v6e names count chips.
TOPOLOGIES = {
  "v4-8": ("v4:2x2x1", "megacore", (2, 2, 1)),
  "v4-16": ("v4:2x2x2", "megacore", (2, 2, 1)),
  "v4-32": ("v4:2x2x4", "megacore", (2, 2, 1)),
  "v4-64": ("v4:2x4x4", "megacore", (2, 2, 1)),
  "v4-128": ("v4:4x4x4", "megacore", (2, 2, 1)),
  "v5e-1": ("v5e:1x1", "default", (1, 1, 1)),
  "v5e-8": ("v5e:2x4", "default", (2, 4, 1)),
  "v5e-16": ("v5e:4x4", "default", (2, 2, 1)),
  "v5e-256": ("v5e:16x16", "default", (2, 2, 1)),
  "v5p-8": ("v5p:2x2x1", "megacore", (2, 2, 1)),
  "v5p-128": ("v5p:4x4x4", "megacore", (2, 2, 1)),
  "v5p-256": ("v5p:4x4x8", "megacore", (2, 2, 1)),
  "v6e-1": ("v6e:1x1", "default", (1, 1, 1)),
  "v6e-8": ("v6e:2x4", "default", (2, 4, 1)),
  "v6e-256": ("v6e:16x16", "default", (2, 2, 1)),
}
TPU_AOT_INSTALL = 'pip install -e ".[tpu-aot]"'


class PlanError(LlamaJaxError, ValueError):
  """A plan cannot be made as asked (unknown topology, no TPU compiler installed); the message says what to do."""


def tpu_devices(topology: str, slices: int = 1) -> list:
  """The abstract devices of a Cloud TPU slice (or `slices` of them), for the TPU compiler; no TPU needed."""
  import importlib.util
  import os

  if topology not in TOPOLOGIES:
    raise PlanError(f"unknown --topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
  if slices < 1:
    raise PlanError(f"--slices must be ≥ 1, got {slices}")
  if importlib.util.find_spec("libtpu") is None:
    raise PlanError(f"--topology needs the TPU compiler (libtpu), which is not installed: {TPU_AOT_INSTALL}")
  # Compiling only: several processes may load libtpu at once (it locks the TPU hardware otherwise), and this host
  # is described to libtpu so that it does not look for a TPU VM's metadata (and print five lines of warnings).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from jax.experimental import topologies

  name, chip_config, host_bounds = TOPOLOGIES[topology]
  return list(
    topologies.get_topology_desc(
      platform="tpu",
      topology_name=name,
      chip_config_name=chip_config,
      chips_per_host_bounds=host_bounds,
      num_slices=slices,
    ).devices
  )


@dataclasses.dataclass
class Plan:
  """Per-device bytes of one compiled train step, and what produced them."""

  mesh: dict[str, int]
  devices: int
  device_kind: str  # e.g. "cpu" (simulated) or "TPU v4"
  compiler: str  # "XLA:CPU estimate" or "TPU compiler"
  n_params: int
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
  collectives: dict[str, dict[str, int]]  # kind → {"count", "bytes"} per device and step (hlo.summarize)
  kernels: dict[str, int]  # custom kernels in the program (splash ...) → executions per step
  compile_seconds: float
  seconds: float

  @property
  def peak_bytes(self) -> int:
    """Arguments, plus outputs not written in place, plus temporaries: what must fit in one device's memory."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def fits(self, hbm_gib: float) -> bool:
    return self.peak_bytes <= hbm_gib * GIB


def device_bytes(abstract_tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard of each array)."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard_shape) * leaf.dtype.itemsize
  return total


def model_config_for_plan(model_cfg, platform: str, seq_len: int):
  """The model as it will be compiled for `platform` (the target devices'): on CPU, accelerator-only attention
  kernels are modelled by "chunked" (the XLA kernel where the sequence is too short to chunk)."""
  if platform == "cpu" and model_cfg.attention in ("auto", "splash", "cudnn"):
    return model_cfg.replace(attention="chunked" if attention_lib.chunk_size(seq_len) else "xla")
  return model_cfg


def plan(run_config: RunConfig, devices=None, hlo_path: str | None = None) -> Plan:
  """Compiles the train step of `run_config` over `devices` (default: all; abstract TPU devices from `tpu_devices`
  for the TPU compiler) without allocating the state; `hlo_path` receives the compiled program's HLO text."""
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
  return Plan(
    mesh=dict(mesh.shape),
    devices=len(devices),
    device_kind=devices[0].device_kind,
    compiler="TPU compiler" if platform == "tpu" else f"XLA:{platform.upper()} estimate",
    n_params=model_cfg.num_params(),
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
    collectives=program.to_dict()["collectives"],
    kernels=program.kernels,
    compile_seconds=compile_seconds,
    seconds=time.perf_counter() - start,
  )


def format_bytes(n: float) -> str:
  for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def report(p: Plan, run_config: RunConfig, hbm_gib: float | None = None) -> str:
  train_cfg, model = run_config.train, run_config.model
  mesh = " × ".join(f"{axis} {size}" for axis, size in p.mesh.items())
  unit, scale = ("GiB", GIB) if p.peak_bytes >= GIB else ("MiB", 2**20)
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
    f"mesh      {mesh} = {p.devices} devices ({p.device_kind}); memory and collectives from the {p.compiler}",
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
  ]
  for kind, c in p.collectives.items():
    lines.append(f"  {kind:<25} {c['count']:>6}   {format_bytes(c['bytes']):>11}")
  if p.kernels:
    lines.append("custom kernels per step: " + ", ".join(f"{name} × {n}" for name, n in p.kernels.items()))
  targets = dict(HBM_GIB)
  if hbm_gib:
    targets[f"--hbm_gib {hbm_gib:g}"] = hbm_gib
  for name, gib in targets.items():
    verdict = "fits" if p.fits(gib) else "does not fit"
    lines.append(f"  {name:<14} {gib:>6g} GiB: {verdict} ({gib - p.peak_bytes / GIB:+.2f} GiB to spare)")
  caveat = "" if p.compiler == "TPU compiler" else "; accelerator compilers differ in temporaries"
  lines.append(f"planned in {p.seconds:.1f} s, of which compile {p.compile_seconds:.1f} s ({p.compiler}{caveat})")
  return "\n".join(lines)


def main(argv=None) -> None:
  from absl import app, flags
  from ml_collections import config_flags

  config_flag = config_flags.DEFINE_config_file("config", None, "run config file, e.g. configs/tpu_v4.py")
  devices_flag = flags.DEFINE_integer("devices", None, "simulated CPU devices (the chips or GPUs of the target)")
  topology_flag = flags.DEFINE_enum(
    "topology",
    None,
    list(TOPOLOGIES),
    "a Cloud TPU slice to compile for with the "
    f"TPU compiler instead of simulated CPU devices (needs {TPU_AOT_INSTALL})",
  )
  slices_flag = flags.DEFINE_integer(
    "slices", 1, "--topology: that many slices (multi-slice; mesh.dcn_data must equal it)"
  )
  hbm_flag = flags.DEFINE_float("hbm_gib", None, "also check against this much memory per device (GiB)")
  json_flag = flags.DEFINE_string("json", None, "also write the plan as JSON to this file")
  hlo_flag = flags.DEFINE_string("hlo", None, "also write the compiled step's HLO text to this file")
  decode_flag = flags.DEFINE_bool("decode", False, "plan decoding (the Sampler's programs) instead of training")
  batch_flag = flags.DEFINE_integer("batch", None, "--decode: rows decoded together")
  max_len_flag = flags.DEFINE_integer("max_len", None, "--decode: KV cache slots per row (default: max_seq_len)")
  prefill_flag = flags.DEFINE_integer(
    "prefill_len", None, "--decode: prompt bucket of the prefill plan (default: --max_len; 0: no prefill plan)"
  )
  dtype_flag = flags.DEFINE_string("dtype", None, "--decode: weights and compute dtype (default: as stored)")
  quantize_flag = flags.DEFINE_string("quantize", "none", "--decode: none | int8 (weight-only)")
  mesh_flag = flags.DEFINE_string("mesh", None, "--decode: decode mesh, e.g. data=1,tensor=-1 (default: all tensor)")
  flags.mark_flags_as_required(["config"])
  decode_only = (batch_flag, max_len_flag, prefill_flag, dtype_flag, quantize_flag, mesh_flag)

  def run(_):
    if decode_flag.value:
      return run_decode()
    for flag in decode_only:
      if flag.present:
        exit_with_error(f"--{flag.name} is a decoding flag: add --decode to plan decoding")
    if (devices_flag.value is None) == (topology_flag.value is None):
      exit_with_error("pass exactly one of --devices N (simulated CPU devices) and --topology NAME (TPU compiler)")
    if devices_flag.value is not None and devices_flag.value < 1:
      exit_with_error(f"--devices must be a positive integer, got {devices_flag.value}")
    if hbm_flag.value is not None and hbm_flag.value <= 0:
      exit_with_error(f"--hbm_gib must be > 0, got {hbm_flag.value}")
    # Set before the first device query initialises a backend: this process computes nothing, it compiles for
    # simulated CPU devices or for abstract TPU devices.
    jax.config.update("jax_platforms", "cpu")
    if devices_flag.value is not None:
      jax.config.update("jax_num_cpu_devices", devices_flag.value)
    run_config = run_config_from_flag_or_exit(config_flag)
    devices = None
    if topology_flag.value is not None:
      if run_config.mesh.dcn_data != slices_flag.value:
        exit_with_error(
          f"--slices {slices_flag.value} needs --config.mesh.dcn_data={slices_flag.value} (the data "
          f"axis spans the slices), got mesh.dcn_data {run_config.mesh.dcn_data}"
        )
      devices = run_or_exit(tpu_devices, topology_flag.value, slices_flag.value)
    result = run_or_exit(plan, run_config, devices, hlo_flag.value)
    print(report(result, run_config, hbm_flag.value))
    if json_flag.value:
      with open(json_flag.value, "w") as f:
        json.dump({**dataclasses.asdict(result), "peak_bytes": result.peak_bytes}, f, indent=2)

  def run_decode():
    from llama_jax import plan_decode

    if batch_flag.value is None:
      exit_with_error("--decode needs --batch B (rows decoded together)")
    if devices_flag.value is None and topology_flag.value is None:
      exit_with_error("pass --devices N (simulated CPU devices) or --topology NAME (TPU compiler)")
    if devices_flag.value is not None and devices_flag.value < 1:
      exit_with_error(f"--devices must be a positive integer, got {devices_flag.value}")
    if hbm_flag.value is not None and hbm_flag.value <= 0:
      exit_with_error(f"--hbm_gib must be > 0, got {hbm_flag.value}")
    jax.config.update("jax_platforms", "cpu")
    if topology_flag.value is None:
      jax.config.update("jax_num_cpu_devices", devices_flag.value)
    run_config = run_config_from_flag_or_exit(config_flag)
    if topology_flag.value is None:
      devices = jax.devices()
    else:
      # --devices with --topology: the first N chips of the slice (a one-chip plan from a v5p-8, say).
      devices = run_or_exit(tpu_devices, topology_flag.value, slices_flag.value)
      if devices_flag.value is not None:
        if devices_flag.value > len(devices):
          exit_with_error(
            f"--devices {devices_flag.value} is more than the {len(devices)} chips of {topology_flag.value}"
          )
        devices = devices[: devices_flag.value]
    max_len = run_config.model.max_seq_len if max_len_flag.value is None else max_len_flag.value
    result = run_or_exit(
      plan_decode.plan,
      run_config,
      devices,
      batch_flag.value,
      max_len,
      dtype=dtype_flag.value,
      quantize=quantize_flag.value,
      mesh_spec=mesh_flag.value,
      prefill_len=prefill_flag.value,
    )
    print(plan_decode.report(result, hbm_flag.value))
    if json_flag.value:
      with open(json_flag.value, "w") as f:
        json.dump(plan_decode.to_json(result), f, indent=2)

  app.run(run, argv, flags_parser=parse_flags_or_exit)


if __name__ == "__main__":
  main()
