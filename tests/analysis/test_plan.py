"""The AOT planner's command line: a real plan for 8 simulated devices, and one-line errors before compiling."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from llama_jax.core.errors import LlamaJaxError
from tests.conftest import ROOT


def run_plan(*args):
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.plan", "--config", "configs/tiny.py", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_plan_of_the_tiny_config_on_8_devices(tmp_path):
  out = tmp_path / "plan.json"
  result = run_plan("--devices", "8", "--config.mesh.fsdp=8", "--hbm_gib", "0.03", "--json", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh      data 1 × fsdp 8 × expert 1 × context 1 × tensor 1 = 8 devices" in result.stdout
  for line in (
    "TPU v4             32 GiB: fits",
    "TPU v5e",
    "TPU v5p",
    "H100",
    "H200",
    "--hbm_gib 0.03   0.03 GiB: does not fit",
  ):
    assert line in result.stdout, result.stdout
  plan = json.loads(out.read_text())
  params, norms = 1_328_256, (2 * 4 + 1) * 128  # tiny: norm scales are replicated, the rest split 8 ways
  assert plan["params_bytes"] == (params - norms) * 4 // 8 + norms * 4
  assert plan["peak_bytes"] == plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"] + plan["temp_bytes"]


def test_plan_errors_name_the_values():
  result = run_plan("--devices", "6", "--config.mesh.fsdp=8")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
    "error: mesh data×fsdp×expert×context×tensor = 1×8×1×1×1 = 8 devices, but 6 devices are available"
  )
  result = run_plan("--devices", "0")
  assert result.returncode == 2 and "--devices must be a positive integer, got 0" in result.stderr


def test_plan_reports_the_collectives_of_the_compiled_step(tmp_path):
  out = tmp_path / "plan.json"
  result = run_plan("--devices", "4", "--config.mesh.fsdp=4", "--json", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(out.read_text())
  assert plan["compiler"] == "XLA:CPU estimate" and plan["device_kind"] == "cpu"
  # FSDP: the step gathers parameters; 4 unrolled layers (tiny.py) × 7 matrices at least once.
  assert plan["collectives"]["all-gather"]["count"] >= 4 * 7, plan["collectives"]
  assert "collectives per step and device" in result.stdout and "all-gather" in result.stdout


def test_topology_errors_are_one_line():
  result = run_plan("--devices", "4", "--topology", "v4-8")
  assert result.returncode == 2
  assert (
    result.stderr.strip() == "error: pass exactly one of --devices N (simulated CPU devices) and --topology NAME "
    "(TPU compiler)"
  )
  result = run_plan("--topology", "v9-1")
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert "v9-1" in result.stderr and "v4-32" in result.stderr  # names the value and the known slices
  result = run_plan("--topology", "v4-8", "--slices", "2")
  assert result.returncode == 2
  assert "--slices 2 needs --config.mesh.dcn_data=2" in result.stderr.strip().splitlines()[-1]


def test_topology_without_libtpu_says_how_to_install_it(monkeypatch):
  import importlib.util

  from llama_jax.analysis import memory, tpu

  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else find_spec(name, *a))
  with pytest.raises(memory.PlanError, match=r'needs the TPU compiler \(libtpu\).*pip install -e "\.\[tpu-aot\]"'):
    tpu.tpu_devices("v4-8")


MESH_SPLIT_SCRIPT = """
from llama_jax.analysis import tpu
from llama_jax.model import sharding
devices = tpu.tpu_devices("v5p-128")
mesh = sharding.make_mesh(dict(data=1, fsdp=8, context=8, tensor=1), devices)
assert dict(mesh.shape) == dict(data=1, fsdp=8, expert=1, context=8, tensor=1), mesh.shape
assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu-aot]"')
def test_a_mesh_axis_that_is_no_product_of_the_slice_s_physical_axes_splits_one():
  """fsdp 8 × context 8 on v5p-128 (4×4×4 chips): jax refuses to lay 8 over whole physical axes of 4 (a traceback
  from `plan` before); the mesh splits one instead, every chip once."""
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", MESH_SPLIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# The decode plan of the tiny config (4 heads, 4 kv heads, 4 layers, tied embeddings) on 8 devices as data 2 ×
# tensor 4: every projection and the vocabulary split 4 ways, norm scales replicated.
TINY_PROJECTIONS = 1_328_256 - (2 * 4 + 1) * 128  # every weight but the norm scales
TINY_NORMS = (2 * 4 + 1) * 128
# int8: one float32 scale per output channel, split with its weight's output axis. Per layer: wq, wk, wv [N, H] and
# [K, H] = 128 each over tensor → 32; wo and w_down [D] = 128 replicated; w_gate, w_up [F] = 352 over tensor → 88.
# Embedding (tied head): [V] = 4096 over tensor → 1024.
TINY_INT8_SCALES = 4 * (3 * 32 + 2 * 128 + 2 * 88) + 1024
DECODE_ARGS = ("--decode", "--devices", "8", "--mesh", "data=2,tensor=4", "--batch", "8", "--max_len", "64")


def decode_cache_bytes(batch, slots, data=2, tensor=4, kv_heads=4, head_dim=32, layers=4, itemsize=4):
  """k and v of every layer, split by row over data and by kv head over tensor; int32 slot positions per row, and
  the int32 slot index."""
  kv = 2 * layers * (batch // data) * (kv_heads // tensor) * slots * head_dim * itemsize
  return kv + (batch // data) * slots * 4 + 4


def test_decode_plan_of_the_tiny_config_on_8_devices(tmp_path):
  out = tmp_path / "plan.json"
  result = run_plan(*DECODE_ARGS, "--hbm_gib", "0.0015", "--json", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh      data 2 × fsdp 1 × expert 1 × context 1 × tensor 4 = 8 devices (cpu)" in result.stdout
  plan = json.loads(out.read_text())
  assert plan["weight_bytes"] == (TINY_PROJECTIONS // 4 + TINY_NORMS) * 4
  assert plan["cache_bytes"] == decode_cache_bytes(8, 64)
  for program in ("decode", "prefill"):
    p = plan[program]
    assert p["rows"] == 8 and plan[f"{program}_more_rows"]["rows"] == 24  # 8 more per device
    assert p["peak_bytes"] == p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
    assert p["argument_bytes"] >= plan["weight_bytes"] + plan["cache_bytes"]
    assert p["widened_weight_bytes"] == 0  # float32 weights: nothing to widen
  assert plan["peak_bytes"] == max(plan["decode"]["peak_bytes"], plan["prefill"]["peak_bytes"])
  # Per token and device: the embedding lookup (vocab split over tensor) and two all-reduces per layer.
  assert plan["collectives"]["all-reduce"]["count"] == 1 + 2 * 4, plan["collectives"]
  for line in (
    "collectives per generated token and device",
    "TPU v4             32 GiB: batch 8 fits",
    "TPU v5e",
    "TPU v5p",
    "H100",
    "H200",
    "--hbm_gib 0.0015 0.0015 GiB: batch 8 does not fit",
  ):
    assert line in result.stdout, result.stdout

  # The largest batch: a multiple of the data axis whose peak, linear through the compiles at 8 and 24 rows, fits
  # where the next multiple's does not.
  def peak_at(batch):
    return max(
      plan[p]["peak_bytes"] + (batch - 8) * (plan[f"{p}_more_rows"]["peak_bytes"] - plan[p]["peak_bytes"]) / 16
      for p in ("decode", "prefill")
    )

  largest = plan["max_batch"]["TPU v5e"]
  assert largest % 2 == 0 and peak_at(largest) <= 16 * 2**30 < peak_at(largest + 2), largest


def test_decode_plan_int8_weights_are_a_quarter_plus_scales(tmp_path):
  out = tmp_path / "plan.json"
  result = run_plan(*DECODE_ARGS, "--quantize", "int8", "--prefill_len", "0", "--json", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(out.read_text())
  assert plan["quantize"] == "int8" and plan["prefill"] is None
  assert plan["weight_bytes"] == TINY_PROJECTIONS // 4 + (TINY_INT8_SCALES + TINY_NORMS) * 4
  float32_bytes = (TINY_PROJECTIONS // 4 + TINY_NORMS) * 4
  assert 3.7 < float32_bytes / plan["weight_bytes"] < 4  # 4× on projections, less the scales and norms
  assert plan["cache_bytes"] == decode_cache_bytes(8, 64)  # the cache stays in the compute dtype
  assert "weights int8 + float32 scales (from float32)" in result.stdout


def test_decode_plan_errors_are_one_line():
  cases = {
    ("--decode", "--devices", "8"): "error: --decode needs --batch B (rows decoded together)",
    (*DECODE_ARGS[:-2], "--max_len", "257"): "error: --max_len must be in [1, 256] (the model's max_seq_len), got "
    "257; raise --config.model.max_seq_len for longer contexts",
    ("--decode", "--devices", "8", "--batch", "1"): "error: a tensor axis of 8 devices does not fit 4 kv heads and 4 "
    "query heads: it must divide n_kv_heads, or be a multiple of n_kv_heads that divides n_heads (kv heads are then "
    "repeated)",
    ("--devices", "8", "--batch", "4"): "error: --batch is a decoding flag: add --decode to plan decoding",
  }
  for args, message in cases.items():
    result = run_plan(*args)
    assert result.returncode == 2, (args, result.stderr[-2000:])
    assert result.stderr.strip().splitlines() == [message], (args, result.stderr[-2000:])


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(batch=0), r"^--batch must be ≥ 1, got 0$"),
    (dict(max_len=0), r"^--max_len must be in \[1, 256\]"),
    (dict(prefill_len=65), r"^--prefill_len must be in \[0, --max_len 64\] \(0: no prefill plan\), got 65$"),
    (dict(quantize="int4"), r"^--quantize must be one of none, int8, got 'int4'$"),
    (dict(prefill_chunk=-1), r"^--prefill_chunk must be ≥ 0 \(0: the whole prompt in one call\), got -1$"),
    (dict(dtype="float64"), r"^--dtype must be one of float32, bfloat16, float16, got 'float64'$"),
  ],
)
def test_decode_plan_refuses_bad_values_before_compiling(kwargs, message):
  import jax

  from llama_jax.analysis import decode_plan
  from llama_jax.core.run_config import load_run_config

  args = dict(batch=8, max_len=64) | kwargs
  with pytest.raises(LlamaJaxError, match=message):
    decode_plan.plan(load_run_config(f"{ROOT}/configs/tiny.py"), jax.devices()[:1], args.pop("batch"), **args)


SAMPLER_AGAINST_PLAN = """
import json
import jax, numpy as np
from llama_jax.analysis import memory, decode_plan
from llama_jax.core.run_config import load_run_config, run_config_from
from llama_jax.inference import placement as inference
from llama_jax.inference.sampler import Sampler
from llama_jax.model import sharding
from llama_jax.model.llama import Llama

model_cfg = run_config_from(load_run_config("configs/tiny.py")).model
mesh = inference.decode_mesh("data=2,tensor=4")
_, params = sharding.abstract_params(Llama, model_cfg)
host = jax.tree.map(lambda a: np.random.default_rng(0).normal(0, 0.02, a.shape).astype(a.dtype), params)
out = {}
for quantize in ("none", "int8"):
  cfg, weights = decode_plan.decode_model(model_cfg, mesh, quantize=quantize)
  cache = decode_plan.abstract_cache(cfg, mesh, inference.decode_rules(cfg, mesh), 6, 48)
  sampler = Sampler(model_cfg, host, eos_id=2, mesh=mesh, quantize=quantize)
  out[quantize] = dict(
    plan=memory.device_bytes(weights) + memory.device_bytes(cache),
    sampler=sampler.weight_bytes_per_device() + sampler.cache_bytes_per_device(6, 48),
    plan_cache=memory.device_bytes(cache),
    sampler_cache=sampler.cache_bytes_per_device(6, 48),
  )
print(json.dumps(out))
"""


def test_decode_plan_bytes_match_a_real_sampler_on_the_same_mesh():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", SAMPLER_AGAINST_PLAN], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  for quantize, numbers in out.items():
    assert numbers["plan"] == numbers["sampler"], (quantize, numbers)  # exact: the same shardings
    assert numbers["plan_cache"] == numbers["sampler_cache"], (quantize, numbers)


def test_decode_plan_largest_batch_per_program_and_when_more_rows_did_not_compile():
  from llama_jax.analysis.decode_plan import DecodePlan, ProgramMemory

  gib = 2**30

  def program(rows, peak_gib):
    return ProgramMemory(
      rows, argument_bytes=int(peak_gib * gib), output_bytes=0, alias_bytes=0, temp_bytes=0, widened_weight_bytes=0
    )

  # decode: 10 GiB + 1 GiB per row; prefill: 4 GiB + 2 GiB per row (the larger from 6 rows on).
  plan = DecodePlan(
    mesh={"data": 2, "fsdp": 1, "expert": 1, "tensor": 1},
    devices=2,
    device_kind="cpu",
    compiler="XLA:CPU estimate",
    n_params=0,
    param_dtype="bfloat16",
    dtype="bfloat16",
    quantize="none",
    n_kv_heads=1,
    kv_repeats=1,
    batch=4,
    rows=4,
    max_len=16,
    prefill_len=16,
    prefill_chunk=0,
    weight_bytes=0,
    expert_weight_bytes=0,
    cache_bytes=0,
    state_bytes=0,
    decode=program(4, 14),
    decode_more_rows=program(6, 16),
    prefill=program(4, 12),
    prefill_more_rows=program(6, 16),
    collectives={},
    kernels={},
    compile_seconds=0,
    seconds=0,
  )
  assert plan.bytes_per_row() == 2 * gib
  assert plan.max_batch(16) == 6 and plan.max_batch(19) == 6 and plan.max_batch(20) == 8  # prefill bounds it
  assert plan.max_batch(13) == 2 and plan.max_batch(11) == 0  # 2 rows: decode 12 GiB, prefill 8 GiB
  # The TPU compiler refused 6 rows of prefill: bounded from 4 rows, with all but the weights (here 8 GiB) per row.
  plan.prefill_more_rows, plan.weight_bytes = None, 8 * gib
  assert plan.bytes_per_row() == 1 * gib  # (12 - 8) / 4 for the prefill, 1 for the decode loop
  assert plan.max_batch(12) == 2 and plan.max_batch(14) == 4 and plan.max_batch(80) == 70


def test_plan_of_the_tiny_config_on_one_device_in_process():
  """The train step's plan on this process's one device, read from the library as the command reads it: every
  weight whole on the device, Adam's two moments beside them, no collectives, and the report's figures."""
  import jax

  from llama_jax.analysis import train_plan as plan_lib
  from llama_jax.core.run_config import load_run_config

  run_config = load_run_config(f"{ROOT}/configs/tiny.py")
  plan = plan_lib.plan(run_config, jax.devices()[:1])
  assert plan.compiler == "XLA:CPU estimate" and plan.devices == 1
  assert plan.n_params == plan.trainable_params == 1_328_256
  assert plan.params_bytes == 1_328_256 * 4
  assert 2 * plan.params_bytes <= plan.opt_state_bytes <= 2 * plan.params_bytes + 64  # mu, nu and a step count
  assert plan.peak_bytes == plan.argument_bytes + plan.output_bytes - plan.alias_bytes + plan.temp_bytes
  assert sum(c["count"] for c in plan.collectives.values()) == 0, plan.collectives
  report = plan_lib.report(plan, run_config, hbm_gib=0.001)
  assert "mesh      data 1 × fsdp 1 × expert 1 × context 1 × tensor 1 = 1 devices" in report, report
  assert "TPU v4             32 GiB: fits" in report and "--hbm_gib 0.001  0.001 GiB: does not fit" in report, report


def test_decode_plan_of_the_tiny_config_on_one_device_in_process():
  """The sampler's decode and prefill programs on one device: every weight and the whole cache on it (the same
  accounting as the 8-device plan above, with data 1 × tensor 1), and the largest batch that fits."""
  import jax

  from llama_jax.analysis import decode_plan
  from llama_jax.core.run_config import load_run_config

  plan = decode_plan.plan(load_run_config(f"{ROOT}/configs/tiny.py"), jax.devices()[:1], 8, 64)
  assert plan.weight_bytes == (TINY_PROJECTIONS + TINY_NORMS) * 4
  assert plan.cache_bytes == decode_cache_bytes(8, 64, data=1, tensor=1)
  for program in (plan.decode, plan.prefill):
    assert program.rows == 8
    assert program.peak_bytes == (
      program.argument_bytes + program.output_bytes - program.alias_bytes + program.temp_bytes
    )
    assert program.argument_bytes >= plan.weight_bytes + plan.cache_bytes
  assert plan.peak_bytes == max(plan.decode.peak_bytes, plan.prefill.peak_bytes)
  assert sum(c["count"] for c in plan.collectives.values()) == 0, plan.collectives

  # The largest batch in 16 GiB: the peak, linear through the compiles at 8 rows and more, fits and one more row's not.
  def peak_at(batch):
    return max(
      p.peak_bytes + (batch - p.rows) * (more.peak_bytes - p.peak_bytes) / (more.rows - p.rows)
      for p, more in ((plan.decode, plan.decode_more_rows), (plan.prefill, plan.prefill_more_rows))
    )

  largest = plan.max_batch(16)
  assert largest > 8 and peak_at(largest) <= 16 * 2**30 < peak_at(largest + 1), largest
  report = decode_plan.report(plan, hbm_gib=0.0001)
  assert "mesh      data 1 × fsdp 1 × expert 1 × context 1 × tensor 1 = 1 devices (cpu)" in report, report
  assert "0.0001 GiB: batch 8 does not fit" in report, report
