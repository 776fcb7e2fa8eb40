"""A server of the real app on a free loopback port, in a thread of the test process (uvicorn, as in production)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests import asgi_server


def rss_mib(pid: int | str = "self") -> float:
  """Resident memory of a process (this one by default), from /proc."""
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def open_fds(pid: int | str = "self") -> int:
  """Open file descriptors of a process (this one by default), from /proc."""
  return len(os.listdir(f"/proc/{pid}/fd"))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(app, timeout: float = 30.0, **connection_limits):
  """Yields the base URL of `app` served on 127.0.0.1 as ``serve`` serves it (serving/connections.py, with
  `connection_limits` such as request_timeout_s); stops the server on exit."""
  from llama_jax.serving import connections

  port = free_port()
  server = connections.server(app, "127.0.0.1", port, **connection_limits)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      raise RuntimeError("the test server did not start")
    time.sleep(0.02)
  try:
    yield f"http://127.0.0.1:{port}"
  finally:
    server.should_exit = True
    thread.join(timeout)


def tiny_checkpoint(out_dir: str, tokenizer_path: str, *, vocab_size: int = 512, max_seq_len: int = 256) -> str:
  """A llama_jax checkpoint directory of a small random GQA model (2 layers, dim 64) with the given tokenizer."""
  from flax import nnx

  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.core.model_config import ModelConfig
  from llama_jax.model.llama import Llama

  cfg = ModelConfig(
    vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=max_seq_len
  )
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0))))
  checkpoint_params.save_params_dir(out_dir, cfg, params, tokenizer_path=tokenizer_path)
  return out_dir


@contextlib.contextmanager
def serving(
  checkpoint_dir: str,
  *,
  slots: int = 4,
  max_len: int = 128,
  api_key: str | None = None,
  warmup: bool = False,
  engine_kwargs: dict | None = None,
  connection_limits: dict | None = None,
  **kw,
):
  """(url, engine, sampler, tokenizer) of a running server over `checkpoint_dir` (its programs compiled first with
  `warmup`, as the CLI does); `kw` go to create_app, `connection_limits` to connections.server; engine and server
  stop on exit. The app is asgi_server's, served on a socket."""
  app_kw = dict(slots=slots, max_len=max_len, api_key=api_key, warmup=warmup, engine_kwargs=engine_kwargs, **kw)
  with asgi_server.started_app(checkpoint_dir, **app_kw) as (app, engine, sampler, tokenizer):
    with running(app, **(connection_limits or {})) as url:
      yield url, engine, sampler, tokenizer


@contextlib.contextmanager
def cli_serving(checkpoint: str, *flags: str, env: dict | None = None, timeout: float = 300.0):
  """(url, process) of ``python -m llama_jax.serve --checkpoint CHECKPOINT FLAGS`` in its own process on a free
  loopback port, once /health answers; on exit it is interrupted as a user would (SIGINT), and `process.stderr_text`
  then holds what it wrote to stderr. A server that exits early, or fails to answer within `timeout`, fails the test
  with its stderr."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = free_port()
  command = [sys.executable, "-m", "llama_jax.serve", "--checkpoint", checkpoint, "--port", str(port), *flags]
  process = subprocess.Popen(
    command, stderr=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
  )
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + timeout
    while True:
      try:
        httpx.get(f"{url}/health", timeout=1)
        break
      except httpx.HTTPError:
        if process.poll() is not None or time.monotonic() > deadline:
          process.kill()
          raise RuntimeError(f"the server did not start: {process.communicate()[1][-3000:]}") from None
        time.sleep(0.2)
    yield url, process
  finally:
    if process.poll() is None:
      process.send_signal(signal.SIGINT)
    try:
      process.stderr_text = process.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
      process.kill()
      process.stderr_text = process.communicate()[1]
