"""The AOT planner's command line: a real plan for 8 simulated devices, and one-line errors before compiling."""

import json
import subprocess
import sys

import pytest

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
  assert "mesh      data 1 × fsdp 8 × tensor 1 = 8 devices" in result.stdout
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
    "error: mesh data×fsdp×tensor = 1×8×1 = 8 devices, but 6 devices are available"
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

  from llama_jax import plan as plan_lib

  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else find_spec(name, *a))
  with pytest.raises(plan_lib.PlanError, match=r'needs the TPU compiler \(libtpu\).*pip install -e "\.\[tpu-aot\]"'):
    plan_lib.tpu_devices("v4-8")
