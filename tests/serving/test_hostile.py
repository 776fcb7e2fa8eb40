"""Hostile callers against the server as ``serve`` runs it (serving/access.py, serving/connections.py): a web page
of another origin, DNS rebinding, wrong and misplaced keys, non-JSON bodies, trickled headers and bodies, idle and
unread connections by the thousand, header floods, out-of-range token ids, JSON bombs. Each case gets its documented
answer; afterwards no slot, file descriptor or memory is held that was not held before, and the server answers a
normal request with the offline greedy text."""

import asyncio
import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from llama_jax.serving import connections
from llama_jax.serving.protocol import Sampling
from llama_jax.serving.streaming import Run
from tests import live_server
from tests.conftest import needs_shakespeare

pytestmark = needs_shakespeare

KEY = "k3y-" + "x" * 28
WRONG_KEY = "k3y-" + "y" * 28  # the same length: only a comparison that looks at every byte tells them apart
ALLOWED = "http://allowed.example:3000"
TIMEOUT_S = 2.0
MAX_CONNECTIONS = 48
BUFFER_TOKENS = 8
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
# Bound on every wait for the server (an answer, a close, a count coming back down): it only ends a hang, for the
# server answers as soon as it can; a loaded 2-core machine may take many times TIMEOUT_S.
WAIT_S = 60.0


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  return live_server.tiny_checkpoint(str(tmp_path_factory.mktemp("hostile") / "tiny"), small_tokenizer)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
  # A 4 KiB kernel send buffer (256 KiB in serve): a stream the client does not read fills it within the tiny model's
  # max_len.
  limits = {"request_timeout_s": TIMEOUT_S, "max_connections": MAX_CONNECTIONS, "send_buffer_bytes": 4096}
  with live_server.serving(
    checkpoint_dir,
    slots=2,
    max_len=128,
    api_key=KEY,
    warmup=True,
    allowed_origins=(ALLOWED,),
    stream_buffer_tokens=BUFFER_TOKENS,
    connection_limits=limits,
  ) as running:
    yield running


def _port(url: str) -> int:
  return urlsplit(url).port


def raw(port: int, data: bytes, wait_s: float = WAIT_S) -> bytes:
  """What the server answers to `data` sent at once, up to its closing the connection (or `wait_s`)."""
  with socket.create_connection(("127.0.0.1", port)) as s:
    s.sendall(data)
    return _read_until_closed(s, wait_s)


def _read_until_closed(s: socket.socket, wait_s: float) -> bytes:
  return _read(s, wait_s)[0]


def _read(s: socket.socket, wait_s: float) -> tuple[bytes, bool]:
  """(what arrives within `wait_s`, whether the server closed the connection by then)."""
  s.settimeout(wait_s)
  received = b""
  try:
    while chunk := s.recv(65536):
      received += chunk
  except TimeoutError:
    return received, False
  except ConnectionResetError:
    pass
  return received, True


def _wait_until(condition, wait_s: float = WAIT_S) -> None:
  """Polls `condition` until it holds or `wait_s` passes (the caller then asserts it, with the values in view)."""
  deadline = time.monotonic() + wait_s
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)


@contextlib.contextmanager
def _connection_log() -> Iterator[list[str]]:
  """What connections.py logs while inside, its drops included (INFO: below what the server shows by default)."""
  logger, messages = logging.getLogger(connections.__name__), []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: messages.append(record.getMessage())  # on the server's thread: a list append
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def _status(response: bytes) -> int:
  return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _completion(prompt="hi", **extra):
  return {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def _error(response: httpx.Response) -> dict:
  return response.json()["error"]


# Each case: (name, method, path, headers, body, status, what the error says). Sent with httpx to 127.0.0.1, so
# Host is 127.0.0.1:PORT unless the case sets it.
CASES = [
  # A web page of another origin: a "simple" POST (text/plain, no preflight), with and without a key.
  ("cross-origin simple POST", "POST", "/v1/completions",
   {"origin": "http://evil.example", "content-type": "text/plain"}, _completion(), 403, "may not call this server"),
  ("cross-origin POST with the key", "POST", "/v1/completions",
   {**AUTH, "origin": "http://evil.example"}, _completion(), 403, "--allowed_origins"),
  ("opaque origin (sandboxed page, file://)", "POST", "/v1/completions",
   {**AUTH, "origin": "null"}, _completion(), 403, "'null' may not call"),
  ("foreign origin reading /health", "GET", "/health", {"origin": "http://evil.example"}, None, 403, "may not call"),
  ("preflight from a foreign origin", "OPTIONS", "/v1/completions",
   {"origin": "http://evil.example", "access-control-request-method": "POST"}, None, 403, "may not call"),
  # DNS rebinding: the attacker's name now resolves to 127.0.0.1; its page is same-origin with itself.
  ("rebinding Host", "GET", "/v1/models", {**AUTH, "host": "attacker.example"}, None, 403, "not a name of this server"),
  ("rebinding Host with its own Origin", "POST", "/v1/completions",
   {**AUTH, "host": "attacker.example:8000", "origin": "http://attacker.example:8000"}, _completion(), 403,
   "'attacker.example:8000' is not a name"),
  ("rebinding Host on the page", "GET", "/", {"host": "attacker.example"}, None, 403, "loopback clients only"),
  ("an address that is not loopback", "GET", "/health", {"host": "192.168.1.10:8000"}, None, 403, "not a name"),
  # Keys.
  ("no key", "POST", "/v1/completions", {"content-type": "application/json"}, _completion(), 401, "API key"),
  ("wrong key of equal length", "POST", "/v1/completions",
   {"authorization": f"Bearer {WRONG_KEY}", "content-type": "application/json"}, _completion(), 401, "API key"),
  ("wrong x-api-key", "POST", "/v1/completions",
   {"x-api-key": WRONG_KEY, "content-type": "application/json"}, _completion(), 401, "x-api-key"),
  ("key in the query string", "POST", f"/v1/completions?api_key={KEY}",
   {"content-type": "application/json"}, _completion(), 401, "API key"),
  ("key as Basic credentials", "GET", "/v1/models", {"authorization": f"Basic {KEY}"}, None, 401, "Bearer"),
  ("unknown /v1/ route without a key", "GET", "/v1/secrets", {}, None, 401, "API key"),
  # Bodies that are not sent as JSON.
  ("text/plain body", "POST", "/v1/completions", {**AUTH, "content-type": "text/plain"}, _completion(), 415,
   "text/plain"),
  ("no Content-Type", "POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY}"},
   {"messages": [{"role": "user", "content": "hi"}]}, 415, "no Content-Type"),
  ("form body", "POST", "/v1/completions", {**AUTH, "content-type": "application/x-www-form-urlencoded"},
   b"prompt=hi", 415, "x-www-form-urlencoded"),
  # What the JSON holds.
  ("token ids outside the vocabulary", "POST", "/v1/completions", AUTH, _completion([1, 2, 10**6]), 400, "prompt"),
  ("negative token id", "POST", "/v1/completions", AUTH, _completion([-1]), 400, "prompt"),
  ("n × prompts past the limit", "POST", "/v1/completions", AUTH, _completion(["a", "b"], n=33), 400, "n:"),
  ("max_tokens past the context", "POST", "/v1/completions", AUTH, {**_completion(), "max_tokens": 128}, 400,
   "max_tokens"),
  ("nested array bomb", "POST", "/v1/completions", AUTH, b"[" * 200_000 + b"]" * 200_000, 400, "not valid JSON"),
  ("nested object bomb", "POST", "/v1/completions", AUTH, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400,
   "not valid JSON"),
  ("an integer of 100,000 digits", "POST", "/v1/completions", AUTH, b'{"prompt": "hi", "max_tokens": '
   + b"9" * 100_000 + b"}", 400, "not valid JSON"),
]  # fmt: skip


def test_each_hostile_request_gets_its_documented_answer(server):
  url = server[0]
  with httpx.Client(base_url=url, timeout=60) as http:
    for name, method, path, headers, body, status, fragment in CASES:
      content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
      try:
        response = http.request(method, path, headers=headers, content=content)
      except httpx.HTTPError as e:  # the server closed on us: a wrong answer too, named
        pytest.fail(f"{name}: {e!r}")
      assert response.status_code == status, (name, response.status_code, response.text[:300])
      error = _error(response)
      assert fragment in error["message"], (name, error)
      assert "access-control-allow-origin" not in response.headers, name
  assert len(CASES) >= 20


def test_allowed_origins_and_keys_in_both_headers_get_through(server):
  url = server[0]
  with httpx.Client(base_url=url, timeout=60) as http:
    preflight = http.options(
      "/v1/completions",
      headers={"origin": ALLOWED, "access-control-request-method": "POST", "access-control-request-headers": "x"},
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    allowed = http.post("/v1/completions", headers={**AUTH, "origin": ALLOWED}, json=_completion())
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    by_header = http.post("/v1/completions", headers={"x-api-key": KEY}, json=_completion())
    lower = http.post("/v1/completions", headers={"authorization": f"bearer {KEY}"}, json=_completion())
    assert by_header.status_code == lower.status_code == 200
    assert by_header.json()["choices"][0]["text"] == allowed.json()["choices"][0]["text"]
    port = _port(url)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.2", "a.localhost"):
      assert http.get("/health", headers={"host": host}).status_code == 200, host
    # The page itself, as a browser fetches it: same origin, no key needed for / and /health.
    own = f"http://127.0.0.1:{port}"
    assert http.get("/", headers={"origin": own}).status_code == 200
    assert http.get("/health", headers={"origin": own}).status_code == 200
    same = http.post("/v1/chat/completions", headers={**AUTH, "origin": own}, json={
      "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0
    })  # fmt: skip
    assert same.status_code == 200


def test_trickled_headers_and_bodies_and_silent_connections_are_dropped(server):
  port = _port(server[0])
  engine = server[1]
  with socket.create_connection(("127.0.0.1", port)) as slow_headers:
    slow_headers.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    # One header byte every 0.25 s, never a complete request, until the server answers or closes: a deadline that
    # restarted with each byte would never come. The bound only ends a hang.
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
      try:
        slow_headers.sendall(b"X")
      except OSError:  # dropped already
        break
      if select.select([slow_headers], [], [], 0.25)[0]:  # an answer, or the close
        break
    answer, closed = _read(slow_headers, WAIT_S)
  assert closed, "a trickling client was never dropped"
  assert _status(answer) in (408, 0), answer
  body = json.dumps(_completion()).encode()
  head = (
    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
  ).encode()
  with socket.create_connection(("127.0.0.1", port)) as slow_body:
    slow_body.sendall(head + body[:5])  # the rest never comes
    answer = _read_until_closed(slow_body, WAIT_S)
  assert _status(answer) == 408 and b"request_timeout_s" in answer
  with socket.create_connection(("127.0.0.1", port)) as silent:
    answer = _read_until_closed(silent, WAIT_S)
  assert _status(answer) == 408
  assert engine.pending() == 0


def test_header_floods_are_refused(server):
  port = _port(server[0])
  many = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 40) for i in range(3000))  # 3,000 headers, ~150 KB
  answer = raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
  assert _status(answer) == 431
  huge = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n"
  assert _status(raw(port, huge)) == 431
  assert _status(raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")) == 200
  lying = (
    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
    f"content-type: application/json\r\ncontent-length: {10**12}\r\n\r\n{{}}"
  ).encode()  # a body that claims a terabyte: refused before any of it is read
  answer = raw(port, lying)
  assert _status(answer) == 413 and b"exceeds the limit" in answer


def test_a_thousand_idle_connections_hit_the_cap_then_go(server):
  url, engine = server[0], server[1]
  port = _port(url)
  before = live_server.open_fds()
  idle = []
  try:
    for _ in range(1000):
      idle.append(socket.create_connection(("127.0.0.1", port)))
    # The server accepts in the order of arrival: when it reads this request, the idle ones before it are its
    # connections (those of the last TIMEOUT_S at least, far more than the cap).
    with socket.create_connection(("127.0.0.1", port)) as s:
      s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
      assert _status(_read_until_closed(s, WAIT_S)) == 503  # past the cap
    # The deadline drops every silent connection: each read ends at its close.
    answers = [_read(s, WAIT_S) for s in idle]
    assert all(closed and _status(answer) == 408 for answer, closed in answers)
  finally:
    for s in idle:
      s.close()
  assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
  _wait_until(lambda: live_server.open_fds() <= before + 4)
  assert live_server.open_fds() <= before + 4, (before, live_server.open_fds())
  assert engine.pending() == 0


def test_an_unread_stream_is_cancelled_and_its_connection_dropped(server):
  """A client that sends a streaming request and reads nothing: its tokens pile up past the buffer, the request is
  cancelled (its slot freed) long before max_tokens, and the connection is dropped after request_timeout_s."""
  url, engine = server[0], server[1]
  port = _port(url)
  tokens_before = engine.stats["tokens"]
  body = json.dumps(
    {"prompt": "the king " * 4, "max_tokens": 110, "temperature": 0.9, "seed": 1, "stream": True, "n": 8,
     "logprobs": 5}
  ).encode()  # fmt: skip
  head = (
    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
  ).encode()
  s = socket.socket()
  s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffers fill sooner
  s.connect(("127.0.0.1", port))
  cancelled_before = engine.stats["finished_cancelled"]
  try:
    with _connection_log() as log:
      s.sendall(head + body)
      _wait_until(lambda: engine.stats["tokens"] != tokens_before)  # admitted and decoding
      _wait_until(lambda: engine.pending() == 0)
      assert engine.pending() == 0
      generated = engine.stats["tokens"] - tokens_before
      assert engine.stats["finished_cancelled"] > cancelled_before and generated < 8 * 110, generated
      # Still reading nothing: the server gives up on the connection once its write has waited request_timeout_s.
      # Reading before then would unblock that write, so the read waits for the server's word that it dropped it.
      _wait_until(lambda: any("read nothing" in message for message in log))
      assert any("read nothing" in message for message in log), log
    received, closed = _read(s, WAIT_S)
    assert closed and received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
  finally:
    s.close()


def test_tokens_that_wait_for_a_slow_handler_do_not_cancel_the_stream(server):
  """The stream buffer's limit applies only while the handler is inside a write (the client reads nothing): outputs
  that pile up while the event loop is busy elsewhere, as on a loaded 2-core CI host where a reading client's stream
  was once cancelled, are delivered whole. The same pile-up during a write is cancelled at the limit."""
  _, engine, sampler, tokenizer = server
  ids = tokenizer.encode("the king", bos=True)
  want = tokenizer.decode(ids + sampler.generate([ids], 24)[0])[len(tokenizer.decode(ids)) :]
  sampling = Sampling(
    max_tokens=24, temperature=0.0, top_p=1.0, top_k=0, seed=1, stop=[], stream=True, include_usage=False, n=1
  )

  async def stream(writing: bool) -> Run:
    run = Run(engine, tokenizer, ids, 24, sampling, None, False, 0)
    run.writing = writing
    run.start(asyncio.get_running_loop(), buffer=BUFFER_TOKENS)
    deadline = time.monotonic() + WAIT_S
    while engine.pending() and time.monotonic() < deadline:  # the loop blocked: every output waits behind it
      time.sleep(0.05)
    while not run.take(await run.queue.get()):
      pass
    return run

  slow = asyncio.run(stream(writing=False))
  assert slow.error is None and not slow.overflowed and slow.choice.n_tokens > BUFFER_TOKENS + 1
  assert slow.choice.text == want
  stalled = asyncio.run(stream(writing=True))
  assert stalled.overflowed and f"the limit is {BUFFER_TOKENS}" in stalled.error
  assert engine.pending() == 0


def test_after_the_battery_nothing_is_held_and_answers_are_greedy(server):
  """Runs last in the module: the whole battery again with slots, descriptors and memory measured around it."""
  url, engine, sampler, tokenizer = server
  prompt = "Shall I compare thee"
  ids = tokenizer.encode(prompt, bos=True)
  want = tokenizer.decode(ids + sampler.generate([ids], 12)[0])[len(tokenizer.decode(ids)) :]
  fds, rss = live_server.open_fds(), live_server.rss_mib()
  test_each_hostile_request_gets_its_documented_answer(server)
  test_header_floods_are_refused(server)
  test_trickled_headers_and_bodies_and_silent_connections_are_dropped(server)
  test_an_unread_stream_is_cancelled_and_its_connection_dropped(server)
  _wait_until(lambda: engine.pending() == engine.busy_slots() == 0 and live_server.open_fds() <= fds + 4)
  assert engine.pending() == 0 and engine.busy_slots() == 0
  assert live_server.open_fds() <= fds + 4, (fds, live_server.open_fds())
  assert live_server.rss_mib() - rss < 64, (rss, live_server.rss_mib())
  answer = httpx.post(
    f"{url}/v1/completions", headers=AUTH, json={**_completion(prompt), "max_tokens": 12}, timeout=WAIT_S
  )
  assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want
