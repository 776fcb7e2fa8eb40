"""The real app served inside the test process through an ASGI client: no socket, no uvicorn, so the protocol tests
run in the fast tier. The tests whose subject is the connection (disconnects, deadlines, the CLI) use live_server.py,
which serves the same app (`started_app`) on a loopback socket."""

from __future__ import annotations

import contextlib

# The app refuses a Host that is not loopback (serving/access.py), and the test client sends its base URL's host.
BASE_URL = "http://127.0.0.1"


@contextlib.contextmanager
def started_app(
  checkpoint_dir: str,
  *,
  slots: int = 4,
  max_len: int = 128,
  api_key: str | None = None,
  warmup: bool = False,
  engine_kwargs: dict | None = None,
  **kw,
):
  """(app, engine, sampler, tokenizer) of the app over a started engine of `checkpoint_dir` (its programs compiled
  first with `warmup`, as the CLI does); `kw` go to create_app; the engine stops on exit."""
  from llama_jax.inference.engine import Engine
  from llama_jax.inference.sampler import load_sampler
  from llama_jax.serving.app import create_app

  sampler, tokenizer = load_sampler(checkpoint_dir)
  engine = Engine(sampler, slots=slots, max_len=max_len, **(engine_kwargs or {}))
  if warmup:
    engine.warmup()
  engine.start()
  try:
    yield create_app(engine, tokenizer, "tiny", api_key=api_key, **kw), engine, sampler, tokenizer
  finally:
    engine.stop()


@contextlib.contextmanager
def asgi_serving(checkpoint_dir: str, **kw):
  """(http, engine, sampler, tokenizer) as live_server.serving yields them, with `http` in place of the URL: a
  TestClient (an httpx.Client) whose requests go straight into the app (paths from the root: "/v1/completions").
  Responses stream as the app sends them, and one read to its end is one the app has finished with (its metrics
  counted). `kw` go to `started_app`."""
  from fastapi.testclient import TestClient

  with started_app(checkpoint_dir, **kw) as (app, engine, sampler, tokenizer):
    with TestClient(app, base_url=BASE_URL) as http:
      yield http, engine, sampler, tokenizer


def openai_client(http, api_key: str = "unused"):
  """The openai package's client, its requests sent through `http` (asgi_serving's TestClient)."""
  import openai

  return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key=api_key, max_retries=0, timeout=120, http_client=http)
