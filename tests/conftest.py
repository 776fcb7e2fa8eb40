import os

# tests/multidevice needs 8 simulated CPU devices, which must be set before jax starts; test_multidevice.py runs it
# in its own pytest process with XLA_FLAGS set, so the main run skips collecting it.
if "xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]
