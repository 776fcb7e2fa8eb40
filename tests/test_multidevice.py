"""Runs tests/multidevice in a separate pytest process on 8 simulated CPU devices."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multidevice_suite_on_8_simulated_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/multidevice"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1800,
  )
  print(result.stdout[-6000:])
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
