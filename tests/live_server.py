"""A server of the real app on a free loopback port, in a thread of the test process (uvicorn, as in production)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(app, timeout: float = 30.0):
  """Yields the base URL of `app` served by uvicorn on 127.0.0.1; stops the server on exit."""
  import uvicorn

  port = free_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
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
  **kw,
):
  """(url, engine, sampler, tokenizer) of a running server over `checkpoint_dir` (its programs compiled first with
  `warmup`, as the CLI does); engine and server stop on exit."""
  from llama_jax.inference.engine import Engine
  from llama_jax.inference.sampler import load_sampler
  from llama_jax.serving.app import create_app

  sampler, tokenizer = load_sampler(checkpoint_dir)
  engine = Engine(sampler, slots=slots, max_len=max_len, **(engine_kwargs or {}))
  if warmup:
    engine.warmup()
  engine.start()
  app = create_app(engine, tokenizer, "tiny", api_key=api_key, **kw)
  try:
    with running(app) as url:
      yield url, engine, sampler, tokenizer
  finally:
    engine.stop()
