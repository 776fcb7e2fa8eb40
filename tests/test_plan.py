"""The AOT planner's command line: a real plan for 8 simulated devices, and one-line errors before compiling."""

import json
import subprocess
import sys

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
