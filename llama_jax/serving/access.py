"""Who may drive the server, checked on every HTTP request before any handler runs (plain ASGI middleware, not
Starlette's BaseHTTPMiddleware, under which a handler never sees its client disconnect).

In order, each a refusal in OpenAI's error shape:

  403  a ``Host`` that is not a loopback name or address, when the server is bound to loopback: a web page that
       rebinds its own DNS name to 127.0.0.1 reaches the port, but its requests carry its name (DNS rebinding, the
       attack behind CVE-2024-28224 on Ollama);
  403  an ``Origin`` that is neither the server's own nor in ``allowed_origins``: any web page the user visits can
       send a "simple" cross-origin POST (no preflight) to a loopback port; browsers always name its origin. CORS
       preflights (``OPTIONS``) are answered for allowed origins only, and their responses carry
       ``Access-Control-Allow-Origin``;
  401  a missing or wrong key on any ``/v1/`` route and on ``/metrics`` when a key is set, taken from
       ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (never from the URL, which lands in logs) and compared in
       constant time;
  415  a POST whose ``Content-Type`` is not ``application/json``: ``text/plain``, form encodings and a missing type
       are exactly what a browser may send cross-origin without asking first;
  413  a ``Content-Length`` over the body limit (a body that turns out longer is cut off by the handler).

``/health`` and the chat page at ``/`` need no key (the page asks for it and sends it); the Host and Origin rules
hold for them too.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import urllib.parse

from llama_jax.serving.protocol import ApiError

JSON_TYPE = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_PREFLIGHT_MAX_AGE_S = 600


def is_loopback(host: str) -> bool:
  """Whether a host name or address (``[::1]``, ``127.0.0.2``, ``localhost``, ``x.localhost``) names this machine
  only. ``.localhost`` names resolve to loopback by RFC 6761, in browsers without asking DNS."""
  host = host.strip().strip("[]").lower().rstrip(".")
  if host == "localhost" or host.endswith(".localhost"):
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _split_host(value: str, scheme: str) -> tuple[str, int] | None:
  """(host, port) of a Host header value ("name:port", "[v6]:port"), or None when it does not parse."""
  try:
    parsed = urllib.parse.urlsplit(f"{scheme}://{value}")
    return (parsed.hostname or "", parsed.port or _DEFAULT_PORTS.get(scheme, 0))
  except ValueError:
    return None


def parse_origin(origin: str) -> tuple[str, str, int] | None:
  """(scheme, host, port) of an origin ("http://localhost:8000"), or None for anything else ("null", a path)."""
  try:
    parsed = urllib.parse.urlsplit(origin)
    port = parsed.port
  except ValueError:
    return None
  if parsed.scheme not in _DEFAULT_PORTS or not parsed.hostname or parsed.path not in ("", "/") or parsed.query:
    return None
  return parsed.scheme, parsed.hostname.lower(), port or _DEFAULT_PORTS[parsed.scheme]


@dataclasses.dataclass(frozen=True)
class Access:
  """The rules of one server: its key (None: no key), the origins other than its own that may call it, whether the
  Host is checked (bound to loopback), and the largest body."""

  api_key: str | None = None
  allowed_origins: tuple[str, ...] = ()
  loopback_only: bool = True
  max_body_bytes: int = 4 * 2**20

  def __post_init__(self):
    parsed = {origin: parse_origin(origin) for origin in self.allowed_origins}
    for origin, split in parsed.items():
      if split is None:
        raise ValueError(
          f"allowed origin {origin!r} is not an origin: scheme://host[:port], e.g. http://localhost:3000"
        )
    object.__setattr__(self, "_allowed", frozenset(parsed.values()))  # parsed once, not on every request

  def origin_allowed(self, origin: str, host: str, scheme: str) -> bool:
    """Whether `origin` is this server's own (as the request's Host names it) or one of the allowed ones."""
    parsed = parse_origin(origin)
    if parsed is None:
      return False
    if parsed in self._allowed:
      return True
    own = _split_host(host, scheme)
    return own is not None and parsed == (scheme, own[0].lower(), own[1])

  def key_matches(self, headers: dict[str, str]) -> bool:
    given = headers.get("x-api-key")
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if given is None and scheme.lower() == "bearer":
      given = token.strip()
    # Constant time: the comparison takes as long however many leading characters match.
    return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"), self.api_key.encode())


class Guard:
  """The ASGI middleware that applies an Access to every HTTP request (see the module docstring)."""

  def __init__(self, app, access: Access, error_response):
    self.app, self.access, self.error_response = app, access, error_response

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    origin = headers.get("origin")
    try:
      self._check(scope, headers, origin)
    except ApiError as error:
      return await self.error_response(error)(scope, receive, send)
    cross_origin = origin is not None
    if cross_origin and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
      return await self._preflight(origin, send)
    if cross_origin:
      send = _with_cors(send, origin)
    return await self.app(scope, receive, send)

  def _check(self, scope, headers: dict[str, str], origin: str | None) -> None:
    access, path = self.access, scope["path"]
    host = headers.get("host")
    if access.loopback_only and host is not None:
      split = _split_host(host, scope.get("scheme", "http"))
      if split is None or not is_loopback(split[0]):
        raise ApiError(
          403,
          f"Host {host[:100]!r} is not a name of this server, which serves loopback clients only (localhost, "
          f"127.0.0.1, [::1]); bind --host to serve others",
          code="forbidden_host",
        )
    if origin is not None and not access.origin_allowed(origin, host or "", scope.get("scheme", "http")):
      raise ApiError(
        403,
        f"Origin {origin[:100]!r} may not call this server; allow it with --allowed_origins",
        code="forbidden_origin",
      )
    if scope["method"] == "OPTIONS":
      return  # a preflight carries no key and no body
    if access.api_key and (path.startswith("/v1/") or path == "/metrics") and not access.key_matches(headers):
      raise ApiError(
        401, "a valid API key is required: Authorization: Bearer KEY, or x-api-key: KEY", code="invalid_api_key"
      )
    if scope["method"] == "POST":
      media_type = headers.get("content-type", "").split(";")[0].strip().lower()
      if media_type != JSON_TYPE:
        given = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
        raise ApiError(415, f"the body must be JSON sent as {JSON_TYPE}, got {given}", code="unsupported_media_type")
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > access.max_body_bytes):
      message = f"request body of {length[:20]} bytes exceeds the limit of {access.max_body_bytes} bytes"
      raise ApiError(413, message, code="too_large")

  async def _preflight(self, origin: str, send) -> None:
    headers = [
      (b"access-control-allow-origin", origin.encode("latin-1")),
      (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
      (b"access-control-allow-headers", b"authorization, content-type, x-api-key"),
      (b"access-control-max-age", str(_PREFLIGHT_MAX_AGE_S).encode()),
      (b"vary", b"Origin"),
      (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send, origin: str):
  """`send` that marks the response readable by `origin` (checked allowed before)."""

  async def cors_send(message):
    if message["type"] == "http.response.start":
      headers = list(message.get("headers", []))
      headers += [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
      message = {**message, "headers": headers}
    await send(message)

  return cors_send
