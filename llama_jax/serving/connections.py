"""The server's connections: uvicorn (httptools' parser when installed, else h11) with deadlines it lacks.

uvicorn bounds the idle time between two requests of a connection (keep-alive, 5 s) but not the time a client may
take to send one: a client that opens a connection and sends nothing, or trickles its headers or body a byte at a
time, holds a connection (a file descriptor, a parser, a slot under the connection cap) for as long as it likes.
Nor does it bound how long a response may wait for a client that stopped reading. ``DeadlineProtocol`` adds both:

  - a request must arrive whole (headers and body) within ``request_timeout_s`` of its first byte, or of the
    connection's opening for its first request; otherwise the client gets ``408 Request Timeout`` and is closed;
  - a request line and headers over ``MAX_HEADER_BYTES`` get ``431`` and the connection closed;
  - a response whose client reads nothing for ``request_timeout_s`` while the server's send buffer is full is
    dropped (the transport aborted, its buffer discarded), which ends the handler and frees its slot.

The connection cap is uvicorn's ``limit_concurrency``: a request arriving while that many connections are open (idle
ones included) gets ``503``; the deadline above is what makes idle ones go away.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

try:
  import uvicorn
  from uvicorn.protocols.http.auto import AutoHTTPProtocol
except ImportError as error:  # pragma: no cover - the message is the point
  raise ImportError(f"{error}: the server needs its extra: pip install -e '.[serve]'") from error

DEFAULT_REQUEST_TIMEOUT_S = 60.0  # nginx's client_header_timeout and client_body_timeout
DEFAULT_MAX_CONNECTIONS = 256
# The kernel's send buffer of each connection (Linux doubles it for its bookkeeping). Left to autotuning, it grows to
# tcp_wmem's maximum (megabytes) for a client that reads nothing: kernel memory held per stalled connection. A token
# stream writes a few hundred bytes per token.
SEND_BUFFER_BYTES = 256 * 2**10
# Request line and headers of one request; beyond it, 431. httptools' parser has no limit of its own (h11's is 16 KiB);
# the largest headers of real clients (cookies of a busy site) stay under 16 KiB.
MAX_HEADER_BYTES = 64 * 2**10


def _plain_response(status: bytes, text: str) -> bytes:
  body = text.encode()
  return (
    b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (status, len(body), body)
  )


_TIMEOUT = _plain_response(b"408 Request Timeout", "the request did not arrive within the server's request_timeout_s")
_HEADERS_TOO_LARGE = _plain_response(
  b"431 Request Header Fields Too Large", f"the request line and headers exceed {MAX_HEADER_BYTES} bytes"
)

_log = logging.getLogger(__name__)


class DeadlineProtocol(AutoHTTPProtocol):
  """uvicorn's HTTP protocol with the two deadlines of the module docstring."""

  def __init__(self, *args, request_timeout_s: float, send_buffer_bytes: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.request_timeout_s, self.send_buffer_bytes = request_timeout_s, send_buffer_bytes
    self._receive_deadline: asyncio.TimerHandle | None = None
    self._write_deadline: asyncio.TimerHandle | None = None
    self._header_bytes = 0

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    sock = transport.get_extra_info("socket")
    if sock is not None and self.send_buffer_bytes:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
    self._arm_receive()  # the first request, from the connection's opening

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    if self.transport.is_closing():
      self._cancel_receive()
      return
    if self._awaiting_headers():
      self._header_bytes += len(data)
      if self._header_bytes > MAX_HEADER_BYTES:
        self._cancel_receive()
        self.transport.write(_HEADERS_TOO_LARGE)
        self.transport.close()
        return
    else:
      self._header_bytes = 0
    if self._receiving():
      self._arm_receive()  # no-op when armed: the deadline counts from the request's first byte
    else:
      self._cancel_receive()

  def pause_writing(self) -> None:  # the transport's buffer passed its high-water mark: the client is not reading
    super().pause_writing()
    if self._write_deadline is None:
      self._write_deadline = self.loop.call_later(self.request_timeout_s, self._drop_stalled)

  def resume_writing(self) -> None:
    super().resume_writing()
    self._cancel_write()

  def connection_lost(self, exc) -> None:
    self._cancel_receive()
    self._cancel_write()
    super().connection_lost(exc)

  def _awaiting_headers(self) -> bool:
    """No request of this connection is being handled: what arrives is the next one's request line and headers
    (uvicorn makes a request's cycle once its headers are complete)."""
    return self.cycle is None or self.cycle.response_complete

  def _receiving(self) -> bool:
    """Whether a request is partly here: headers begun but not complete, or its body short."""
    return self._awaiting_headers() or self.cycle.more_body

  def _arm_receive(self) -> None:
    if self._receive_deadline is None:
      self._receive_deadline = self.loop.call_later(self.request_timeout_s, self._drop_slow_request)

  def _cancel_receive(self) -> None:
    if self._receive_deadline is not None:
      self._receive_deadline.cancel()
      self._receive_deadline = None

  def _cancel_write(self) -> None:
    if self._write_deadline is not None:
      self._write_deadline.cancel()
      self._write_deadline = None

  def _drop_slow_request(self) -> None:
    self._receive_deadline = None
    if self.transport.is_closing() or not self._receiving():
      return
    cycle = self.cycle
    if cycle is None or cycle.response_complete or not cycle.response_started:
      self.transport.write(_TIMEOUT)
    _log.info("dropped a client whose request did not arrive within %.0f s", self.request_timeout_s)
    self.transport.close()

  def _drop_stalled(self) -> None:
    self._write_deadline = None
    _log.info("dropped a client that read nothing for %.0f s", self.request_timeout_s)
    self.transport.abort()  # close() would wait to flush what the client does not read


def server(
  app,
  host: str,
  port: int,
  *,
  request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
  max_connections: int = DEFAULT_MAX_CONNECTIONS,
  send_buffer_bytes: int = SEND_BUFFER_BYTES,
  log_level: str = "warning",
) -> uvicorn.Server:
  """The uvicorn server of `app` (``serve`` and the tests alike); ``run()`` serves until interrupted."""
  config = uvicorn.Config(
    app,
    host=host,
    port=port,
    log_level=log_level,
    http=functools.partial(DeadlineProtocol, request_timeout_s=request_timeout_s, send_buffer_bytes=send_buffer_bytes),
    limit_concurrency=max_connections,
    lifespan="off",
  )
  return uvicorn.Server(config)
