"""Ahead-of-time memory plans: compile the real train step (or the Sampler's decode programs) for a mesh, allocate
nothing, report per-device memory, collectives and kernels, and whether it fits v4/v5e/v5p/v6e/H100/H200.

    python -m llama_jax.plan --config configs/tpu_v4.py --devices 16 [--hbm_gib 32] [--config.a.b=v]
    python -m llama_jax.plan --config configs/tpu_v4.py --topology v4-32 [--slices N] [--json F]
    python -m llama_jax.plan --decode --config configs/llama2_7b.py --devices 1 --batch 8 --max_len 4096 [...]

- ``--devices N``: XLA's CPU compiler for N simulated CPU devices. Temporaries are an estimate (a TPU or GPU compiler
  fuses and schedules differently; parameter and optimizer bytes are exact), and attention kernels that exist only
  on accelerators (splash, cudnn) are modelled by the "chunked" XLA attention.
- ``--topology v4-32``: the real TPU compiler (libtpu, the ``tpu-aot`` extra) for that slice's abstract TPU devices,
  on any host and with no TPU: the TPU kernels (splash attention) are in the program, and memory, collectives and
  fusion are the TPU compiler's own.

The plans are ``analysis/train_plan.py`` (training) and ``analysis/decode_plan.py`` (decoding).
"""

from __future__ import annotations

import dataclasses
import json
import types

import jax
from absl import flags

from llama_jax import cli
from llama_jax.analysis import decode_plan, train_plan
from llama_jax.analysis.tpu import TOPOLOGIES, TPU_AOT_INSTALL, tpu_devices
from llama_jax.core.errors import FlagError, run_or_exit

DECODE_ONLY = ("batch", "max_len", "prefill_len", "prefill_chunk", "dtype", "quantize", "mesh")


def main(argv=None) -> None:
  config_flag = cli.define_config_flag(argv, "configs/tpu_v4.py")
  defined = dict(
    devices=flags.DEFINE_integer("devices", None, "simulated CPU devices (the chips or GPUs of the target)"),
    topology=flags.DEFINE_enum(
      "topology",
      None,
      list(TOPOLOGIES),
      "a Cloud TPU slice to compile for with the TPU compiler instead of simulated CPU devices "
      f"(needs {TPU_AOT_INSTALL})",
    ),
    slices=flags.DEFINE_integer("slices", 1, "--topology: that many slices (multi-slice; mesh.dcn_data must equal it)"),
    hbm_gib=flags.DEFINE_float("hbm_gib", None, "also check against this much memory per device (GiB)"),
    json=flags.DEFINE_string("json", None, "also write the plan as JSON to this file"),
    hlo=flags.DEFINE_string("hlo", None, "also write the compiled step's HLO text to this file"),
    decode=flags.DEFINE_bool("decode", False, "plan decoding (the Sampler's programs) instead of training"),
    batch=flags.DEFINE_integer("batch", None, "--decode: rows decoded together"),
    max_len=flags.DEFINE_integer("max_len", None, "--decode: KV cache slots per row (default: max_seq_len)"),
    prefill_len=flags.DEFINE_integer(
      "prefill_len", None, "--decode: prompt bucket of the prefill plan (default: --max_len; 0: no prefill plan)"
    ),
    prefill_chunk=flags.DEFINE_integer(
      "prefill_chunk", None, "--decode: prefill the prompt this many tokens per model call (as sample --prefill_chunk)"
    ),
    dtype=flags.DEFINE_string("dtype", None, "--decode: weights and compute dtype (default: as stored)"),
    quantize=flags.DEFINE_string("quantize", "none", "--decode: none | int8 (weight-only)"),
    mesh=flags.DEFINE_string("mesh", None, "--decode: decode mesh, e.g. data=1,tensor=-1 (default: all tensor)"),
  )

  def run(_):
    given = types.SimpleNamespace(**{name: flag.value for name, flag in defined.items()})
    given.present = {name for name, flag in defined.items() if flag.present}
    run_or_exit(_check_flags, given)
    # Set before the first device query initialises a backend: this process computes nothing, it compiles for
    # simulated CPU devices or for abstract TPU devices.
    jax.config.update("jax_platforms", "cpu")
    if given.topology is None:
      jax.config.update("jax_num_cpu_devices", given.devices)
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    run_or_exit(_plan_decoding if given.decode else _plan_training, given, run_config)

  cli.run_absl_command(run, argv, (config_flag, *defined.values()))


def _check_flags(given) -> None:
  if given.decode and given.batch is None:
    raise FlagError("--decode needs --batch B (rows decoded together)")
  if not given.decode:
    for name in DECODE_ONLY:
      if name in given.present:
        raise FlagError(f"--{name} is a decoding flag: add --decode to plan decoding")
    if (given.devices is None) == (given.topology is None):
      raise FlagError("pass exactly one of --devices N (simulated CPU devices) and --topology NAME (TPU compiler)")
  elif given.devices is None and given.topology is None:
    raise FlagError("pass --devices N (simulated CPU devices) or --topology NAME (TPU compiler)")
  if given.devices is not None and given.devices < 1:
    raise FlagError(f"--devices must be a positive integer, got {given.devices}")
  if given.hbm_gib is not None and given.hbm_gib <= 0:
    raise FlagError(f"--hbm_gib must be > 0, got {given.hbm_gib}")


def _plan_training(given, run_config) -> None:
  devices = None
  if given.topology is not None:
    if run_config.mesh.dcn_data != given.slices:
      raise FlagError(
        f"--slices {given.slices} needs --config.mesh.dcn_data={given.slices} (the data axis spans the slices), got "
        f"mesh.dcn_data {run_config.mesh.dcn_data}"
      )
    devices = tpu_devices(given.topology, given.slices)
  result = train_plan.plan(run_config, devices, given.hlo)
  print(train_plan.report(result, run_config, given.hbm_gib))
  if given.json:
    with open(given.json, "w") as f:
      json.dump({**dataclasses.asdict(result), "peak_bytes": result.peak_bytes}, f, indent=2)


def _plan_decoding(given, run_config) -> None:
  if given.topology is None:
    devices = jax.devices()
  else:
    # --devices with --topology: the first N chips of the slice (a one-chip plan from a v5p-8, say).
    devices = tpu_devices(given.topology, given.slices)
    if given.devices is not None:
      if given.devices > len(devices):
        raise FlagError(f"--devices {given.devices} is more than the {len(devices)} chips of {given.topology}")
      devices = devices[: given.devices]
  max_len = run_config.model.max_seq_len if given.max_len is None else given.max_len
  result = decode_plan.plan(
    run_config,
    devices,
    given.batch,
    max_len,
    dtype=given.dtype,
    quantize=given.quantize,
    mesh_spec=given.mesh,
    prefill_len=given.prefill_len,
    prefill_chunk=given.prefill_chunk or 0,
  )
  print(decode_plan.report(result, given.hbm_gib))
  if given.json:
    with open(given.json, "w") as f:
      json.dump(decode_plan.to_json(result), f, indent=2)


if __name__ == "__main__":
  main()
