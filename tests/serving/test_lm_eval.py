r"""lm-evaluation-harness against the server: its `local-completions` model runs a small multiple-choice task
(tests/fixtures/lm_eval_task) through /v1/completions (echo + logprobs, token ids tokenized client-side by the HF
export of the checkpoint), and every log-likelihood it records equals llama_jax's own full forward of the same ids.

What the test runs, as a user would from the repository root (HF_DIR holds the tokenizer: `python -m
llama_jax.convert --to_hf CKPT --out HF_DIR`, plus the tokenizer_config.json below; the server: `python -m
llama_jax.serve --checkpoint CKPT --model_name tiny --max_len 128`):

    lm-eval run --model local-completions --tasks llama_jax_tiny_facts --include_path tests/fixtures/lm_eval_task \
      --model_args model=tiny base_url=http://127.0.0.1:8000/v1/completions tokenizer_backend=huggingface \
        tokenizer=HF_DIR tokenized_requests=True add_bos_token=True max_length=128 num_concurrent=1 max_retries=1 \
      --output_path OUT --log_samples
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, needs_shakespeare, skip_or_fail
from tests.live_server import serving, tiny_checkpoint

pytestmark = [needs_shakespeare, pytest.mark.usefixtures("lm_eval_installed")]

TASK_DIR = os.path.join(ROOT, "tests", "fixtures", "lm_eval_task")
TASK = "llama_jax_tiny_facts"
DATA_FILE = "tests/fixtures/lm_eval_task/tiny_facts.jsonl"  # as the shipped YAML names it (relative to the repo root)
MAX_LEN = 128
# What AutoTokenizer needs beyond tokenizer.model to add bos as LLaMA does (`convert --to_hf` does not write it yet):
# without it transformers builds a tokenizer that matches sentencepiece piece for piece but never adds bos.
# No tokenizer_class: "LlamaTokenizer" would rebuild the pre-tokenizer and split leading spaces differently.
TOKENIZER_CONFIG = {
  "bos_token": "<s>",
  "eos_token": "</s>",
  "unk_token": "<unk>",
  "add_bos_token": True,
  "add_eos_token": False,
}


@pytest.fixture(scope="module")
def lm_eval_installed():
  # lm-eval's API models need its [api] extra (aiohttp, tenacity, ...): it refuses to start without them.
  for package in ("lm_eval", "transformers", "aiohttp", "tenacity", "tqdm", "requests"):
    if importlib.util.find_spec(package) is None:
      skip_or_fail(f"{package} is not installed (pip install 'lm-eval[api]>=0.4.8')")


def run(args, **kwargs):
  result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300, **kwargs)
  assert result.returncode == 0, f"{args[:4]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
  return result


def start_hf_export(checkpoint_dir: str, out_dir: str) -> subprocess.Popen:
  """`convert --to_hf` of the checkpoint, in the background (it overlaps the server's start)."""
  return subprocess.Popen(
    [sys.executable, "-m", "llama_jax.convert", "--to_hf", checkpoint_dir, "--out", out_dir],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


def finish_hf_export(process: subprocess.Popen, out_dir: str) -> str:
  """Waits for the export; adds the tokenizer_config.json it lacks (only if it lacks one)."""
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 0, f"convert --to_hf failed ({process.returncode}):\n{output}"
  config = os.path.join(out_dir, "tokenizer_config.json")
  if not os.path.exists(config):
    with open(config, "w") as f:
      json.dump(TOKENIZER_CONFIG, f, indent=2)
  return out_dir


def task_dir(tmp_path) -> str:
  """A copy of the shipped task whose data_files path is absolute (load_dataset resolves it against the cwd)."""
  out = tmp_path / "task"
  out.mkdir()
  text = open(os.path.join(TASK_DIR, "tiny_facts.yaml")).read()
  assert DATA_FILE in text
  (out / "tiny_facts.yaml").write_text(text.replace(DATA_FILE, os.path.join(ROOT, DATA_FILE)))
  return str(out)


def model_args(url: str, hf_dir: str) -> dict:
  return dict(
    model="tiny",
    base_url=f"{url}/v1/completions",
    tokenizer_backend="huggingface",
    tokenizer=hf_dir,
    tokenized_requests=True,
    add_bos_token=True,
    max_length=MAX_LEN,
    num_concurrent=1,
    max_retries=1,
  )


def full_logprobs(checkpoint_dir: str, tokens_BT: np.ndarray) -> np.ndarray:
  """Log-probabilities [B, T, V] (float64) of one full forward of the stacked model read from the checkpoint: not
  the engine's bucketed prefill into a KV cache."""
  import jax
  from flax import nnx

  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.model import sharding
  from llama_jax.model.llama import Llama

  cfg, params = checkpoint_params.load_params(checkpoint_dir)
  graphdef, _ = sharding.abstract_params(Llama, cfg)
  logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens_BT), np.float64)
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def own_loglikelihoods(checkpoint_dir: str, requests: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
  """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per (ids, context length), all
  in one batch right-padded (causal: padding after a sequence changes nothing before it)."""
  tokens = np.zeros((len(requests), max(len(ids) for ids, _ in requests)), np.int32)
  for row, (ids, _) in enumerate(requests):
    tokens[row, : len(ids)] = ids
  logprobs = full_logprobs(checkpoint_dir, tokens)
  out = []
  for row, (ids, ctxlen) in enumerate(requests):
    positions = np.arange(ctxlen - 1, len(ids) - 1)  # position t predicts token t + 1
    targets = np.asarray(ids[ctxlen:])
    total = float(logprobs[row, positions, targets].sum())
    greedy = bool((logprobs[row, positions].argmax(-1) == targets).all())
    out.append((total, greedy))
  return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  return tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), small_tokenizer)


@pytest.fixture(scope="module")
def server(lm_eval_installed, checkpoint_dir, tmp_path_factory):
  """(url, engine, tokenizer, HF directory) of the server over the checkpoint, shared by the tests (its programs
  compile once); the HF export runs while the server starts."""
  hf_dir = str(tmp_path_factory.mktemp("export") / "hf")
  export = start_hf_export(checkpoint_dir, hf_dir)
  with serving(checkpoint_dir, slots=4, max_len=MAX_LEN) as (url, engine, _, tokenizer):
    yield url, engine, tokenizer, finish_hf_export(export, hf_dir)


def test_lm_eval_loglikelihoods_equal_llama_jax_scoring(tmp_path, checkpoint_dir, server, monkeypatch):
  url, engine, tokenizer, hf_dir = server
  out_dir = tmp_path / "lm_eval_out"
  env = {
    **os.environ,
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),
    "TOKENIZERS_PARALLELISM": "false",
  }
  sent = []  # the prompt ids of each engine request: what lm-eval sent, as the server received them
  submit = engine.submit
  monkeypatch.setattr(engine, "submit", lambda request: sent.append(list(request.prompt)) or submit(request))
  args = [f"{key}={value}" for key, value in model_args(url, hf_dir).items()]
  command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--tasks", TASK]
  command += ["--include_path", task_dir(tmp_path), "--model_args", *args]
  command += ["--output_path", str(out_dir), "--log_samples"]
  result = run(command, env=env)
  monkeypatch.undo()

  table = [line for line in result.stdout.splitlines() if line.startswith(f"|{TASK}")]
  print("\n" + "\n".join(table))
  assert len(table) == 1 and "|acc|" in table[0].replace(" ", ""), result.stdout
  (results_file,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
  acc = json.load(open(results_file))["results"][TASK]["acc,none"]
  (samples_file,) = glob.glob(str(out_dir / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
  samples = sorted((json.loads(line) for line in open(samples_file)), key=lambda sample: sample["doc_id"])
  docs = [json.loads(line) for line in open(os.path.join(ROOT, DATA_FILE))]
  assert [sample["doc"] for sample in samples] == docs
  assert [int(sample["target"]) for sample in samples] == [doc["answer"] for doc in docs]

  # Each (context, continuation) as lm-eval's causal models split it (TemplateLM._encode_pair: trailing spaces of
  # the context move to the continuation, the whole is encoded and cut after the context's tokens), with bos
  # (add_bos_token=True) and llama_jax's tokenizer: the server must have received exactly these ids.
  requests, pairs = [], []
  for sample in samples:
    for argument in sample["arguments"].values():
      context, continuation = argument["arg_0"], argument["arg_1"]
      stripped = context.rstrip()
      ids = tokenizer.encode(stripped + context[len(stripped) :] + continuation, bos=True)
      requests.append((ids, len(tokenizer.encode(stripped, bos=True))))
    # multiple_choice: one [loglikelihood, is_greedy] per choice, written as strings in the samples file.
    pairs += [(float(loglikelihood), str(greedy) == "True") for loglikelihood, greedy in sample["filtered_resps"]]
  assert len(requests) == len(pairs) == sum(len(doc["choices"]) for doc in docs)
  assert sorted(sent) == sorted(ids for ids, _ in requests), "lm-eval's token ids differ from llama_jax's tokenizer"
  assert max(len(ids) for ids in sent) < MAX_LEN  # nothing truncated

  own = own_loglikelihoods(checkpoint_dir, requests)
  theirs = np.asarray([loglikelihood for loglikelihood, _ in pairs], np.float64)
  mine = np.asarray([loglikelihood for loglikelihood, _ in own])
  diff = np.abs(theirs - mine).max()
  print(f"{len(requests)} loglikelihoods, max |lm-eval - llama_jax| = {diff:.2e}, acc {acc}")
  assert diff <= 1e-4, np.stack([theirs, mine], axis=1)
  assert [greedy for _, greedy in pairs] == [greedy for _, greedy in own]
  # lm-eval's accuracy equals the one of our own scores: the highest-scoring choice against each answer.
  per_doc, start = [], 0
  for doc in docs:
    n = len(doc["choices"])
    per_doc.append(float(np.argmax(mine[start : start + n]) == doc["answer"]))
    start += n
  assert acc == pytest.approx(np.mean(per_doc))


def test_lm_eval_scores_a_continuation_the_model_would_follow_with_eos(checkpoint_dir, server):
  """lm-eval asks for max_tokens=1 with echo and cuts the generated token off the end of the logprobs (vLLM lists
  an eos there like any token). A prompt after which greedy decoding ends at once must still score right: were eos
  left out of the listing, lm-eval would drop the continuation's last token and score it 0 (probability 1)."""
  import requests
  from lm_eval.models.openai_completions import LocalCompletionsAPI

  prompts = np.random.RandomState(0).randint(3, 512, (16384, 6)).astype(np.int32)
  prompts[:, 0] = 1  # bos
  ends = np.flatnonzero(full_logprobs(checkpoint_dir, prompts)[:, -1].argmax(-1) == 2)  # eos next
  assert len(ends), "no random prompt of this model is followed by eos"
  ids = prompts[ends[0]].tolist()
  # The payload of LocalCompletionsAPI._create_payload(generate=False) for context ids[:-1], continuation ids[-1:].
  payload = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
  response = requests.post(f"{server[0]}/v1/completions", json={**payload, "echo": True}, timeout=120)
  assert response.status_code == 200, response.text
  ((loglikelihood, greedy),) = LocalCompletionsAPI.parse_logprobs(outputs=response.json(), ctxlens=[len(ids) - 1])
  ((own, own_greedy),) = own_loglikelihoods(checkpoint_dir, [(ids, len(ids) - 1)])
  assert abs(loglikelihood - own) <= 1e-4 and greedy == own_greedy, (loglikelihood, own, response.json())
