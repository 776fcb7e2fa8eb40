"""Serve a checkpoint over an OpenAI-compatible HTTP API, with a web chat page at `/`.

    python -m llama_jax.serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--max_len L]
        [--api_key KEY] [--allowed_origins URL,...] [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8]

Endpoints: GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions (both stream as
server-sent events with `"stream": true`), GET / (the chat page). Errors come in OpenAI's shape with 400 (a bad
value, named with its allowed range; a prompt + max_tokens beyond the context), 401 (missing or wrong key when
--api_key is set), 403 (a Host or Origin that may not call), 404 (unknown model or route), 408 (a request that did
not arrive within --request_timeout_s), 413 (a body over --max_body_mb), 415 (a body not sent as JSON) and 503 (the
queue or the connection cap full). The engine (``inference/engine.py``) runs in its own thread; the application is
``serving/app.py``, its access rules ``serving/access.py``, its connections' deadlines ``serving/connections.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys

from llama_jax import cli
from llama_jax.core import distributed, paths
from llama_jax.core.errors import FlagError, run_or_exit
from llama_jax.inference import placement
from llama_jax.inference.engine import PREFILL_TOKENS, STEPS_PER_CALL, Engine
from llama_jax.inference.sampler import describe_placement, load_sampler
from llama_jax.serving import connections
from llama_jax.serving.access import Access, is_loopback
from llama_jax.serving.app import DEFAULT_MAX_BODY_MB, create_app
from llama_jax.serving.streaming import STREAM_BUFFER_TOKENS


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
  access = _check_access(args)
  if args.request_timeout_s <= 0:
    raise FlagError(f"--request_timeout_s must be > 0, got {args.request_timeout_s}")
  if args.max_connections < 1:
    raise FlagError(f"--max_connections must be ≥ 1, got {args.max_connections}")
  if args.stream_buffer_tokens < 1:
    raise FlagError(f"--stream_buffer_tokens must be ≥ 1, got {args.stream_buffer_tokens}")
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
    prefill_chunk=args.prefill_chunk,
  )
  name = args.model_name or paths.name(args.checkpoint)
  app = create_app(
    engine,
    tokenizer,
    name,
    api_key=access.api_key,
    max_body_bytes=access.max_body_bytes,
    allowed_origins=access.allowed_origins,
    loopback_only=access.loopback_only,
    stream_buffer_tokens=args.stream_buffer_tokens,
  )
  compiled = "programs compile on first use" if args.skip_warmup else f"programs compiled in {engine.warmup():.1f} s"
  engine.start()
  if not access.loopback_only and not access.api_key:
    print(
      f"warning: serving {args.host} without an API key (--insecure_no_api_key): anyone who can reach port "
      f"{args.port} can use this machine's compute",
      file=sys.stderr,
    )
  print(
    f"serving {name!r} on http://{args.host}:{args.port} ({engine.slots} slots × {engine.max_len} tokens"
    f"{', API key required' if access.api_key else ''}; {compiled})",
    file=sys.stderr,
    flush=True,
  )
  server = connections.server(
    app,
    args.host,
    args.port,
    request_timeout_s=args.request_timeout_s,
    max_connections=args.max_connections,
    log_level=args.log_level,
  )
  try:
    server.run()
  finally:
    engine.stop()


def _check_access(args) -> Access:
  """The access rules the flags ask for; a server others can reach must have a key, unless told otherwise."""
  api_key = args.api_key or os.environ.get("LLAMA_JAX_API_KEY") or None
  loopback = is_loopback(args.host)
  if not loopback and not api_key and not args.insecure_no_api_key:
    raise FlagError(
      f"--host {args.host} serves other machines, but no --api_key (or LLAMA_JAX_API_KEY) is set: anyone who can "
      f"reach the port could use it; set a key, or pass --insecure_no_api_key to serve without one"
    )
  origins = tuple(o.strip().rstrip("/") for o in args.allowed_origins.split(",") if o.strip())
  try:
    return Access(api_key, origins, loopback, int(args.max_body_mb * 2**20))
  except ValueError as error:
    raise FlagError(f"--allowed_origins: {error}") from None


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
    "--prefill_chunk",
    type=int,
    default=0,
    help="prefill prompts longer than this many tokens (a power of two) one chunk per decode call, so running "
    "streams keep getting tokens while a long prompt arrives (default 0: whole prompts)",
  )
  parser.add_argument(
    "--max_queue", type=int, default=1024, help="requests waiting for a slot before new ones get 503 (overloaded)"
  )
  parser.add_argument(
    "--api_key", help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/ (or set LLAMA_JAX_API_KEY)"
  )
  parser.add_argument(
    "--allowed_origins",
    default="",
    help="comma-separated web origins (http://host:port) other than the server's own whose pages may call it",
  )
  parser.add_argument(
    "--insecure_no_api_key",
    action="store_true",
    help="serve a non-loopback --host without an API key (refused otherwise)",
  )
  parser.add_argument(
    "--request_timeout_s",
    type=float,
    default=connections.DEFAULT_REQUEST_TIMEOUT_S,
    help="a request must arrive whole within this (else 408); a client that reads nothing this long is dropped",
  )
  parser.add_argument(
    "--max_connections",
    type=int,
    default=connections.DEFAULT_MAX_CONNECTIONS,
    help="open connections beyond which a request gets 503",
  )
  parser.add_argument(
    "--stream_buffer_tokens",
    type=int,
    default=STREAM_BUFFER_TOKENS,
    help="tokens of a stream that may wait for a client that reads nothing before the request is cancelled",
  )
  parser.add_argument(
    "--skip_warmup",
    action="store_true",
    help="answer at once and compile each program when a request first needs it (a quicker start for development; "
    "the first request of each prompt length then waits for its compile)",
  )
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
