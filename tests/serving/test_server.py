"""The HTTP server with real clients: the `openai` package (completions, chat, streaming, errors), a battery of
malformed requests (each the documented 4xx, the server serving normally after), the API key, and a bounded load
test on loopback with clients that disconnect mid-stream. Greedy answers are checked against the offline Sampler
decoding the same prompt alone. The protocol is tested in-process (asgi_server.py); what needs real connections (the
load test, a client that leaves, the command) runs on a loopback socket (live_server.py)."""

import concurrent.futures
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest

from tests import asgi_server, live_server
from tests.conftest import needs_shakespeare

pytestmark = needs_shakespeare


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  return live_server.tiny_checkpoint(str(tmp_path_factory.mktemp("serve") / "tiny"), small_tokenizer)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
  """(http, engine, sampler, tokenizer): the app in this process. Not warmed up: each program compiles when a test
  first needs it, which costs the fast tier less than compiling them all (the load test warms its own server)."""
  with asgi_server.asgi_serving(checkpoint_dir, slots=8, max_len=128) as served:
    yield served


@pytest.fixture(scope="module")
def socket_server(checkpoint_dir):
  """(url, engine, sampler, tokenizer) on a loopback socket, for the load test whose subject is connections. Its own
  engine: the load test counts the engine's requests and cancellations. Warmed up: every program compiled before
  the test, so its memory rounds see no compilation."""
  with live_server.serving(checkpoint_dir, slots=8, max_len=128, warmup=True) as served:
    yield served


@pytest.fixture(scope="module")
def client(server):
  return asgi_server.openai_client(server[0])


def greedy_text(server, prompt_ids, max_tokens, budget=None):
  """The offline Sampler's greedy continuation of `prompt_ids` alone, as text. With `budget` ≥ max_tokens the
  Sampler runs `budget` tokens and the first max_tokens are kept (greedy decoding is prefix-consistent), so many
  lengths share one compiled program."""
  _, _, sampler, tokenizer = server
  new = sampler.generate([prompt_ids], budget or max_tokens)[0][:max_tokens]
  return tokenizer.decode(prompt_ids + new)[len(tokenizer.decode(prompt_ids)) :], len(new)


def test_models_and_health(server, client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  health = server[0].get("/health").json()
  assert health["status"] == "ok" and health["slots"] == 8


def test_completion_equals_the_offline_sampler(server, client):
  tokenizer = server[3]
  prompt = "Shall I compare thee"
  want, n = greedy_text(server, tokenizer.encode(prompt, bos=True), 20)
  response = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
  choice = response.choices[0]
  assert choice.text == want
  assert choice.finish_reason == ("length" if n == 20 else "stop")
  assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, bos=True))
  assert response.usage.completion_tokens == n + (n < 20)  # an eos that ended the text counts


def test_streamed_completion_is_the_same_text_in_pieces(server, client):
  prompt = "When in disgrace with fortune"
  whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
  chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
  pieces = [c.choices[0].text for c in chunks if c.choices]
  assert "".join(pieces) == whole
  assert sum(1 for p in pieces if p) >= 2  # it came in pieces
  assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_a_batch_of_prompts_gives_one_choice_each_in_order(server, client):
  tokenizer = server[3]
  prompts = ["Good morrow", "A horse! a horse!", "Now is the winter"]
  response = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
  assert [c.index for c in response.choices] == [0, 1, 2]
  for prompt, choice in zip(prompts, response.choices):
    assert choice.text == greedy_text(server, tokenizer.encode(prompt, bos=True), 8)[0]
  assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p, bos=True)) for p in prompts)


def test_n_choices_sample_differently_and_count_the_prompt_once(server, client):
  messages = [{"role": "user", "content": "Speak, sweet."}]
  kwargs = dict(model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=3, n=3)
  response = client.chat.completions.create(**kwargs)
  texts = [c.message.content for c in response.choices]
  assert [c.index for c in response.choices] == [0, 1, 2] and len(set(texts)) == 3
  from llama_jax.data import chat_template as chat

  assert response.usage.prompt_tokens == len(chat.encode_dialog(server[3], messages).tokens)
  streamed = ["", "", ""]
  for chunk in client.chat.completions.create(**kwargs, stream=True):
    for choice in chunk.choices:
      streamed[choice.index] += choice.delta.content or ""
  assert streamed == texts


def test_chat_completion_uses_the_llama2_template(server, client):
  from llama_jax.data import chat_template as chat

  tokenizer = server[3]
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
  ids = chat.encode_dialog(tokenizer, messages).tokens
  want, _ = greedy_text(server, ids, 16)
  response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
  assert response.choices[0].message.role == "assistant"
  assert response.choices[0].message.content == want
  stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
  assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_end_the_text_before_them(server, client):
  full = client.completions.create(model="tiny", prompt="To be, or not", max_tokens=30, temperature=0).choices[0]
  stop = full.text[5:7]
  assert stop.strip(), "the greedy text should have a non-blank piece to stop at"
  cut = full.text[: full.text.find(stop)]
  for stream in (False, True):
    response = client.completions.create(
      model="tiny", prompt="To be, or not", max_tokens=30, temperature=0, stop=[stop], stream=stream
    )
    if stream:
      chunks = [c for c in response if c.choices]
      text = "".join(c.choices[0].text for c in chunks)
      finish = chunks[-1].choices[0].finish_reason
    else:
      text, finish = response.choices[0].text, response.choices[0].finish_reason
    assert (text, finish) == (cut, "stop")


def test_echo_with_logprobs_scores_the_prompt(server, client):
  """What loglikelihood evaluation asks: echo + logprobs + max_tokens 0 give each prompt token's log-probability
  (None for the first), its text and offset, and the top alternatives."""
  _, _, sampler, tokenizer = server
  prompt = "O Romeo, Romeo"
  ids = tokenizer.encode(prompt, bos=True)
  response = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
  logprobs = response.choices[0].logprobs
  assert response.choices[0].text == tokenizer.decode(ids)
  assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
  assert "".join(logprobs.tokens) == response.choices[0].text
  assert all(response.choices[0].text[o:].startswith(t) for o, t in zip(logprobs.text_offset, logprobs.tokens))
  from flax import nnx

  model = nnx.merge(sampler.graphdef, sampler.params)
  import jax

  want = jax.nn.log_softmax(model(np.asarray([ids]))[0], axis=-1)
  np.testing.assert_allclose(
    logprobs.token_logprobs[1:], [float(want[t - 1, ids[t]]) for t in range(1, len(ids))], atol=1e-4
  )
  assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])


def test_seeded_sampling_is_reproducible(client):
  kwargs = dict(model="tiny", prompt="Friends, Romans", max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
  first = client.completions.create(**kwargs).choices[0].text
  assert client.completions.create(**kwargs).choices[0].text == first
  assert client.completions.create(**{**kwargs, "seed": 8}).choices[0].text != first


def test_openai_client_sees_errors_as_exceptions(client):
  import openai

  with pytest.raises(openai.BadRequestError) as error:
    client.completions.create(model="tiny", prompt="x" * 10, max_tokens=127)
  assert error.value.code == "context_length_exceeded"
  assert "exceeds the context length 128" in error.value.message
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


BATTERY = [
  # (endpoint, body (dict, or raw bytes), status, a fragment of the message)
  ("completions", b"{not json", 400, "not valid JSON"),
  ("completions", b"[1, 2]", 400, "must be a JSON object"),
  ("completions", {"prompt": 5}, 400, "prompt: must be a string"),
  ("completions", {"prompt": ""}, 400, "prompt 0 is empty"),
  ("completions", {"prompt": []}, 400, "prompt: must be"),
  ("completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
  ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens: must be in [0, 128], got -1"),
  ("completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens: must be in [0, 128]"),
  ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens: must be an integer"),
  ("completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens: must be an integer"),
  ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens: must be ≥ 1 unless echo"),
  ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p: must be in (0, 1], got 0"),
  ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature: must be in [0, 2]"),
  ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature: must be a number"),
  ("completions", {"prompt": "hi", "top_k": -5}, 400, "top_k: must be in [-1, 512], got -5"),
  ("completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs: must be in [0, 5]"),
  ("completions", {"prompt": "hi", "stop": 3}, 400, "stop: must be a non-empty string"),
  ("completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400, "at most 16"),
  ("completions", {"prompt": "hi", "top_k": 10**6}, 400, "top_k: must be in [-1, 512]"),
  ("completions", {"prompt": "hi", "max_tokens": 10**400}, 400, "max_tokens: must be in [0, 128]"),
  ("completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "prompt: the text cannot be encoded"),
  ("completions", {"prompt": ["hi"] * 65}, 400, "at most 64 prompts per request"),
  ("completions", {"prompt": ["hi"] * 8, "n": 9}, 400, "8 prompts × n 9 is more than the 64 choices"),
  ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of: is not supported"),
  (
    "chat/completions",
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    400,
    "tools: is not supported",
  ),
  (
    "chat/completions",
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500},
    400,
    "max_completion_tokens: must be in [0, 128]",
  ),
  ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream: must be true or false"),
  ("completions", {"prompt": "hi", "n": 0}, 400, "n: must be in [1, 64]"),
  ("completions", {"prompt": "hi", "seed": -1}, 400, "seed: must be in [0, 4294967295]"),
  ("completions", {"prompt": "hi", "presence_penalty": 1.0}, 400, "presence_penalty: is not supported"),
  ("completions", {"prompt": "x " * 200, "max_tokens": 16}, 400, "exceeds the context length 128"),
  ("completions", {"prompt": "hi", "model": "other"}, 404, "model 'other' does not exist"),
  ("chat/completions", {"messages": []}, 400, "messages: must be a non-empty list"),
  ("chat/completions", {"messages": "hello"}, 400, "messages: must be a non-empty list"),
  ("chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, 400, "unknown role 'bot'"),
  ("chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "empty content"),
  (
    "chat/completions",
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    400,
    "turns must alternate",
  ),
  (
    "chat/completions",
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    400,
    "must end with a user turn",
  ),
  ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "needs logprobs"),
  ("nothing/here", {"prompt": "hi"}, 404, "Not Found"),
]


def test_malformed_requests_get_the_documented_4xx_and_the_server_keeps_serving(server):
  http = server[0]
  for endpoint, body, status, fragment in BATTERY:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, (endpoint, body, response.text)
    error = response.json()["error"]
    assert fragment in error["message"], (body, error)
    assert set(error) == {"message", "type", "param", "code"}
  big_body = b'{"prompt": "' + b"a" * (10 * 2**20) + b'"}'
  big = http.post("/v1/completions", content=big_body, headers={"content-type": "application/json"})
  assert big.status_code == 413 and "exceeds the limit" in big.json()["error"]["message"]
  assert http.get("/v1/completions").status_code == 405
  ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
  assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
  assert len(BATTERY) + 2 >= 20


def test_api_key_is_required_when_set(checkpoint_dir):
  import openai

  with asgi_server.asgi_serving(checkpoint_dir, slots=2, max_len=64, api_key="sesame") as (http, *_):
    assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    wrong = asgi_server.openai_client(http, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
      wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    right = asgi_server.openai_client(http, api_key="sesame")
    assert right.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).choices
    assert http.get("/health").status_code == 200  # health stays open for probes


def load_round(server, n_requests=64, n_clients=16, n_disconnects=8, seed=0):
  """n_requests from n_clients threads (mixed prompt lengths, half streamed) plus n_disconnects streams dropped
  after their first chunk. Returns (results by request index, disconnected count)."""
  url, _, _, tokenizer = server
  rs = np.random.RandomState(seed)
  words = "the king is dead long live my lord sweet love of night and day".split()
  jobs = []
  for i in range(n_requests):
    prompt = " ".join(rs.choice(words, rs.randint(1, 40)))
    jobs.append(dict(index=i, prompt=prompt, max_tokens=int(rs.randint(1, 40)), stream=bool(i % 2)))
  results = {}
  lock = threading.Lock()

  def complete(job):
    body = {
      "model": "tiny",
      "prompt": job["prompt"],
      "max_tokens": job["max_tokens"],
      "temperature": 0,
      "stream": job["stream"],
    }
    with httpx.Client(timeout=300) as http:
      if job["stream"]:
        texts, finishes, done = [], [], 0
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
          assert response.status_code == 200
          for line in response.iter_lines():
            if line == "data: [DONE]":
              done += 1
            elif line.startswith("data: "):
              choice = json.loads(line[6:])["choices"][0]
              texts.append(choice["text"])
              if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
        result = dict(text="".join(texts), finishes=finishes, done=done)
      else:
        response = http.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        result = dict(text=choices[0]["text"], finishes=[c["finish_reason"] for c in choices], done=1)
    with lock:
      assert job["index"] not in results
      results[job["index"]] = result

  def disconnect(i):
    body = {"model": "tiny", "prompt": "the king " * 5, "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.Client(timeout=300) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
      for line in response.iter_lines():
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
          return 1  # leaving the with-block closes the connection mid-stream
    return 0

  with concurrent.futures.ThreadPoolExecutor(n_clients + n_disconnects) as pool:
    dropped = [pool.submit(disconnect, i) for i in range(n_disconnects)]
    futures = [pool.submit(complete, job) for job in jobs]
    for future in futures + dropped:
      future.result(timeout=600)
  return jobs, results, sum(f.result() for f in dropped)


def test_load_with_concurrent_and_disconnecting_clients(socket_server):
  """64 requests from 16 concurrent clients and 8 streams dropped mid-way: every request answered exactly once with
  exactly the offline greedy text; the dropped streams' slots are freed and reused; memory flat across rounds."""
  url, engine, sampler, tokenizer = socket_server
  before_requests = engine.stats["requests"]
  before_cancelled = engine.stats["finished_cancelled"]
  jobs, results, dropped = load_round(socket_server, seed=0)
  assert sorted(results) == list(range(len(jobs)))
  for job in jobs:
    result = results[job["index"]]
    want, n = greedy_text(socket_server, tokenizer.encode(job["prompt"], bos=True), job["max_tokens"], budget=40)
    assert result["text"] == want, job
    assert result["finishes"] == ["length" if n == job["max_tokens"] else "stop"] and result["done"] == 1
  assert dropped == 8
  deadline = time.monotonic() + 60
  while engine.pending() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert engine.pending() == 0, "slots still held after every client left"
  assert engine.stats["finished_cancelled"] - before_cancelled == 8
  assert engine.stats["requests"] - before_requests == 72  # 72 requests through 8 slots: slots were reused
  # Memory: a second and third round of the same traffic leave the process's resident size where the first did.
  load_round(socket_server, seed=1)
  settled = live_server.rss_mib()
  load_round(socket_server, seed=2)
  grown = live_server.rss_mib() - settled
  print(f"resident memory after round 2: {settled:.0f} MiB; round 3 added {grown:+.1f} MiB")
  assert grown < 32, f"resident memory grew {grown:.1f} MiB over one more round of 72 requests"
  assert os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"


@pytest.mark.parametrize(
  ("flags", "message"),
  [
    (["--slots", "0"], "--slots must be ≥ 1, got 0"),
    (["--max_len", "100000"], "max_len must be in [2, 256] (the model's max_seq_len), got 100000"),
    (["--port", "70000"], "--port must be in [1, 65535], got 70000"),
    (["--checkpoint", "/nonexistent"], "/nonexistent"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 serves other machines, but no --api_key (or LLAMA_JAX_API_KEY) is set"),
    (["--host", "192.0.2.7"], "set a key, or pass --insecure_no_api_key to serve without one"),
    (["--request_timeout_s", "0"], "--request_timeout_s must be > 0, got 0.0"),
    (["--max_connections", "0"], "--max_connections must be ≥ 1, got 0"),
    (["--stream_buffer_tokens", "0"], "--stream_buffer_tokens must be ≥ 1, got 0"),
    (["--prefill_chunk", "24"], "prefill_chunk must be 0 (whole prompts) or a power of two ≤ max_len 256, got 24"),
    (["--allowed_origins", "evil.example"], "--allowed_origins: allowed origin 'evil.example' is not an origin"),
  ],
)
def test_cli_bad_flags_are_one_line_exit_2(checkpoint_dir, capsys, flags, message):
  from llama_jax import serve

  with pytest.raises(SystemExit) as exit_info:
    serve.main(["--checkpoint", checkpoint_dir, *flags])
  assert exit_info.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last


def test_cli_serves_until_interrupted(checkpoint_dir):
  with live_server.cli_serving(checkpoint_dir, "--slots", "2", "--max_len", "64") as (url, server):
    health = httpx.get(f"{url}/health")
    assert health.json()["model"] == os.path.basename(checkpoint_dir)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] > 0
  assert server.returncode == 0, server.stderr_text
  assert f"serving 'tiny' on {url} (2 slots × 64 tokens; programs compiled in" in server.stderr_text


def test_cli_serves_other_machines_without_a_key_only_when_told_and_warns(checkpoint_dir, capsys, monkeypatch):
  """--insecure_no_api_key: the server starts (here: its uvicorn server is replaced before it binds anything, so
  nothing listens beyond loopback) and says on every start that anyone can use it."""
  from llama_jax import serve
  from llama_jax.serving import connections

  started = []

  class NotListening:
    def run(self):
      started.append(True)

  monkeypatch.setattr(connections, "server", lambda app, host, port, **kw: NotListening())
  monkeypatch.delenv("LLAMA_JAX_API_KEY", raising=False)
  flags = ["--checkpoint", checkpoint_dir, "--host", "0.0.0.0", "--slots", "1", "--max_len", "32"]
  assert serve.main([*flags, "--insecure_no_api_key"]) == 0 and started
  err = capsys.readouterr().err
  assert "warning: serving 0.0.0.0 without an API key (--insecure_no_api_key): anyone who can reach port 8000" in err
  assert serve.main([*flags, "--api_key", "k"]) == 0 and len(started) == 2
  assert "warning" not in capsys.readouterr().err


def test_the_earliest_stop_string_wins_whatever_their_order(server):
  from llama_jax.serving.protocol import Choice

  tokenizer = server[3]
  ids = tokenizer.encode("hello world foo")
  for stops in (["world", "lo w"], ["lo w", "world"]):
    choice = Choice(tokenizer, [], stops, None)
    choice.add(ids)
    assert (choice.text, choice.stopped) == ("hel", True)


def test_a_token_prompt_ending_inside_a_character_loses_no_text(server):
  from llama_jax.serving.protocol import Detokenizer

  tokenizer = server[3]
  ids = tokenizer.encode("naïve café — fin")
  splits = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
  assert splits, "the text should split inside a multi-byte character somewhere"
  for k in splits:
    detokenizer = Detokenizer(tokenizer, ids[:k])
    new = "".join(detokenizer.add(t) for t in ids[k:]) + detokenizer.flush()
    assert tokenizer.decode(ids[:k]).rstrip("\ufffd") + new == tokenizer.decode(ids), k


def test_a_full_queue_is_503_and_a_failing_step_ends_only_the_running_requests(checkpoint_dir):
  with asgi_server.asgi_serving(checkpoint_dir, slots=2, max_len=64, engine_kwargs=dict(max_queue=0)) as (http, *_):
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
  with asgi_server.asgi_serving(checkpoint_dir, slots=2, max_len=64) as (http, engine, *_):
    run_rows = engine._run_rows

    def fails_once(*args):
      engine._run_rows = run_rows
      raise RuntimeError("simulated device failure")

    engine._run_rows = fails_once
    broken = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
    assert broken.status_code == 500 and "simulated device failure" in broken.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get("/health").json()["status"] == "ok"


def test_a_non_streaming_client_that_leaves_frees_its_slot(checkpoint_dir):
  """The engine is paced (a pause after each call) so the request is still running when the client gives up. 0.5 s a
  step: with 0.2 s, a CI run on 2 busy cores saw the request end by itself (its eos after 44 steps, 8.8 s) before
  the disconnect (checked every 0.5 s) was noticed; a reply now takes at least 22 s to end that way."""
  with live_server.serving(checkpoint_dir, slots=2, max_len=128) as (url, engine, *_):
    step = engine.step

    def paced_step():
      busy = step()
      if busy:
        time.sleep(0.5)
      return busy

    engine.step = paced_step
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 120}, timeout=1.5)
    deadline = time.monotonic() + 70
    while engine.pending() and time.monotonic() < deadline:
      time.sleep(0.1)
    assert engine.pending() == 0 and engine.stats["finished_cancelled"] == 1, dict(engine.stats)
    assert engine.stats["tokens"] < 100  # cancelled, not run to max_tokens
