"""The lean load generator: HTTP/1.1 clients of the server on one asyncio thread that parse only what they measure.

bench/serve.py drives the server with it, and so does the soak (tests/serving/test_soak.py, which imports it as
``bench.load``): standard library only, so it loads the same way from both. Why not httpx in threads: they spent 0.85
of the 4.6 core-seconds of a 16-client bench/serve.py run on a 2-core machine, time the server's XLA threads then
lacked; this client spends 0.04 (measured, Intel Xeon, 2026-12-02).

A `Connection` is one kept-alive connection; `Connection.request` sends one POST and reads its answer, a JSON body
(Content-Length) or a server-sent event stream (chunked), or hangs up at a chosen point of the exchange, as a client
that crashes, times out or loses interest does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

# Where a client may hang up: after half its body, with the request sent but nothing read, after the response's head,
# after the first streamed event with text.
HANG_UPS = ("mid_body", "before_answer", "after_head", "mid_stream")


@dataclasses.dataclass
class Reply:
  status: int
  text: str = ""  # the first choice's text: streamed pieces joined, or the whole JSON answer's
  first_text_s: float | None = None  # request sent → first text seen
  completion_tokens: int | None = None  # from usage, where the server sent it
  finish_reason: str | None = None
  error: dict | None = None  # the JSON error object of a non-200 answer or of a stream's error event
  done: bool = False  # a stream's `data: [DONE]` arrived (a JSON answer: always True)


class Connection:
  """One HTTP/1.1 connection to 127.0.0.1:`port`, reopened by `request` after a hang-up or a server close."""

  def __init__(self, port: int, headers: dict[str, str] | None = None):
    self.port = port
    self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    self.reader: asyncio.StreamReader | None = None
    self.writer: asyncio.StreamWriter | None = None

  async def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
      try:
        await self.writer.wait_closed()
      except OSError:  # the server reset it first
        pass
    self.reader = self.writer = None

  async def request(self, path: str, body: dict, hang_up: str | None = None) -> Reply | None:
    """POST `body` as JSON to `path`: the Reply, or None when `hang_up` (one of HANG_UPS) ended the exchange early.
    A stream that carries no text (an error event, or zero tokens) still ends with the server's answer at
    `mid_stream`."""
    if self.writer is None:
      self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
    reader, writer = self.reader, self.writer
    payload = json.dumps(body).encode()
    head = (
      f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n{self.headers}"
      f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sent = time.perf_counter()
    if hang_up == "mid_body":
      writer.write(head + payload[: len(payload) // 2])
      await writer.drain()
      await self.close()
      return None
    writer.write(head + payload)
    await writer.drain()
    if hang_up == "before_answer":
      await self.close()
      return None
    response_head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status = int(response_head.split(" ", 2)[1])
    fields = dict(
      (name.strip().lower(), value.strip())
      for name, _, value in (line.partition(":") for line in response_head.split("\r\n")[1:])
      if name
    )
    if hang_up == "after_head":
      await self.close()
      return None
    reply = Reply(status)
    if fields.get("transfer-encoding", "").lower() != "chunked":
      data = json.loads(await reader.readexactly(int(fields.get("content-length", 0))))
      if status != 200:
        reply.error = data.get("error", data)
      else:
        choice = data["choices"][0]
        reply.text = choice["text"] if "text" in choice else choice["message"]["content"]
        reply.first_text_s = time.perf_counter() - sent
        reply.finish_reason = choice["finish_reason"]
        reply.completion_tokens = data["usage"]["completion_tokens"]
        reply.done = True
    else:
      pending = b""
      while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
          break
        pending += data[:-2]
        *events, pending = pending.split(b"\n\n")
        for event in events:
          if event == b"data: [DONE]":
            reply.done = True
            continue
          self._absorb(reply, json.loads(event[6:]), sent)
        if hang_up == "mid_stream" and reply.text:
          await self.close()
          return None
    if fields.get("connection", "").lower() == "close":
      await self.close()
    return reply

  @staticmethod
  def _absorb(reply: Reply, event: dict, sent: float) -> None:
    if "error" in event:
      reply.error = event["error"]
      return
    if event.get("usage"):
      reply.completion_tokens = event["usage"]["completion_tokens"]
    if not event.get("choices"):
      return
    choice = event["choices"][0]
    piece = choice["text"] if "text" in choice else choice.get("delta", {}).get("content") or ""
    if piece and reply.first_text_s is None:
      reply.first_text_s = time.perf_counter() - sent
    reply.text += piece
    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason


def completion_body(model: str, prompt, max_tokens: int, stream: bool) -> dict:
  """A greedy /v1/completions request (usage included in streams, as the bench counts tokens from it)."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
  if stream:
    body["stream_options"] = {"include_usage": True}
  return body


def closed_loop(port: int, work: list, model: str, max_tokens: int, clients: int) -> list[Reply]:
  """`clients` connections, each sending the next of `work` (prompts, in order) as a greedy streamed completion when
  its last one has ended; the Replies in `work`'s order."""
  queue = list(enumerate(work))[::-1]  # popped from the end: in order
  replies: dict[int, Reply] = {}

  async def client():
    connection = Connection(port)
    try:
      while queue:
        index, prompt = queue.pop()
        reply = await connection.request("/v1/completions", completion_body(model, prompt, max_tokens, True))
        if reply.status != 200 or reply.error:
          raise RuntimeError(f"request {index} answered {reply.status}: {reply.error}")
        replies[index] = reply
    finally:
      await connection.close()

  async def run():
    await asyncio.gather(*(client() for _ in range(clients)))

  asyncio.run(run())
  return [replies[i] for i in range(len(work))]
