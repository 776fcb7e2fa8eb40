"""Serve a checkpoint over an OpenAI-compatible HTTP API, with a web chat page at `/`.

    python -m llama_jax.serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--max_len L]
        [--api_key KEY] [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8]

Endpoints: GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions (both stream as
server-sent events with `"stream": true`), GET / (the chat page). Errors come in OpenAI's shape with 400 (a bad
value, named with its allowed range; a prompt + max_tokens beyond the context), 401 (missing or wrong key when
--api_key is set), 404 (unknown model or route) and 413 (a body over --max_body_mb). The engine
(``inference/engine.py``) runs in its own thread; the application is ``serving/app.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys

from llama_jax import cli
from llama_jax.core import distributed
from llama_jax.core.errors import FlagError, run_or_exit
from llama_jax.inference import placement
from llama_jax.inference.engine import PREFILL_TOKENS, STEPS_PER_CALL, Engine
from llama_jax.inference.sampler import describe_placement, load_sampler
from llama_jax.serving.app import DEFAULT_MAX_BODY_MB, create_app


def serve(args) -> None:
  """Loads the checkpoint, starts the engine and serves until interrupted."""
  if args.slots < 1:
    raise FlagError(f"--slots must be ≥ 1, got {args.slots}")
  if args.max_queue < 1:
    raise FlagError(f"--max_queue must be ≥ 1, got {args.max_queue}")
  if args.max_prefill_tokens is not None and args.max_prefill_tokens < 1:
    raise FlagError(f"--max_prefill_tokens must be ≥ 1, got {args.max_prefill_tokens}")
  if not 0 < args.port < 65536:
    raise FlagError(f"--port must be in [1, 65535], got {args.port}")
  mesh = placement.decode_mesh(args.mesh)
  sampler, tokenizer = load_sampler(args.checkpoint, mesh, args.dtype, args.quantize, args.step)
  if distributed.is_main_process():
    print(describe_placement(sampler), file=sys.stderr)
  engine = Engine(
    sampler,
    slots=args.slots,
    max_len=args.max_len,
    steps_per_call=args.steps_per_call,
    max_queue=args.max_queue,
    max_prefill_tokens=args.max_prefill_tokens,
  )
  name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
  api_key = args.api_key or os.environ.get("LLAMA_JAX_API_KEY")
  app = create_app(engine, tokenizer, name, api_key=api_key, max_body_bytes=int(args.max_body_mb * 2**20))
  seconds = engine.warmup()
  engine.start()
  print(
    f"serving {name!r} on http://{args.host}:{args.port} ({engine.slots} slots × {engine.max_len} tokens"
    f"{', API key required' if api_key else ''}; programs compiled in {seconds:.1f} s)",
    file=sys.stderr,
    flush=True,
  )
  try:
    import uvicorn  # the serve extra's, as FastAPI is (serving/app.py names the extra when it is missing)

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  finally:
    engine.stop()


def add_serve_flags(parser) -> None:
  parser.add_argument(
    "--checkpoint", required=True, help="llama_jax checkpoint directory (a workdir or convert output)"
  )
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--slots", type=int, default=8, help="requests decoded together (one KV cache row each)")
  parser.add_argument("--max_len", type=int, help="tokens per slot, prompt + completion (default: max_seq_len)")
  parser.add_argument("--steps_per_call", type=int, default=STEPS_PER_CALL, help="decode steps per compiled call")
  parser.add_argument(
    "--max_prefill_tokens",
    type=int,
    help=f"rows × prompt bucket prefilled in one call (default: max_len or {PREFILL_TOKENS}, the larger)",
  )
  parser.add_argument(
    "--max_queue", type=int, default=1024, help="requests waiting for a slot before new ones get 503 (overloaded)"
  )
  parser.add_argument("--api_key", help="require 'Authorization: Bearer KEY' (or set LLAMA_JAX_API_KEY)")
  parser.add_argument("--model_name", help="the model id clients use (default: the checkpoint's directory name)")
  parser.add_argument("--max_body_mb", type=float, default=DEFAULT_MAX_BODY_MB, help="largest request body accepted")
  parser.add_argument("--log_level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
  cli.add_model_flags(parser)


def main(argv: list[str] | None = None) -> int:
  parser = cli.ArgumentParser(prog="python -m llama_jax.serve", description=__doc__.split("\n\n")[0])
  add_serve_flags(parser)
  args = parser.parse_args(argv)
  with contextlib.suppress(KeyboardInterrupt):
    run_or_exit(serve, args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
