"""SFT and chat: the LLaMA 2 template against Meta's tokenizer, loss masks, conversation checks, packing without
cross-talk, and the pretrain → SFT → chat pipeline end to end."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax import chat, chat_data, data
from llama_jax.config import ModelConfig
from llama_jax.loss import token_losses
from llama_jax.model import Llama
from llama_jax.tokenizer import Tokenizer
from tests.conftest import ROOT, needs_shakespeare

META_TOKENIZER = os.path.join(ROOT, "..", "shared", "fixtures", "llama2-tokenizer", "tokenizer.model")
needs_meta = pytest.mark.skipif(not os.path.isfile(META_TOKENIZER), reason="Meta's LLaMA 2 tokenizer fixture is absent")
DIALOG = [
  {"role": "system", "content": "Always answer as Shakespeare would."},
  {"role": "user", "content": "What is the weather like?"},
  {"role": "assistant", "content": "Fair is foul, and foul is fair."},
  {"role": "user", "content": "And tomorrow?"},
  {"role": "assistant", "content": "Tomorrow, and tomorrow, and tomorrow."},
]


@needs_meta
def test_template_ids_equal_metas_format_built_by_hand():
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor(model_file=META_TOKENIZER)
  system, u1, a1, u2, a2 = (m["content"] for m in DIALOG)
  by_hand = (
    [1]
    + sp.encode(f"[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{u1} [/INST] {a1} ")
    + [2]
    + [1]
    + sp.encode(f"[INST] {u2} [/INST] {a2} ")
    + [2]
  )
  encoded = chat.encode_dialog(Tokenizer(META_TOKENIZER), DIALOG)
  assert encoded.tokens == by_hand
  prompt = chat.encode_dialog(Tokenizer(META_TOKENIZER), DIALOG[:4])
  assert prompt.tokens == by_hand[: by_hand.index(2) + 1] + [1] + sp.encode(f"[INST] {u2} [/INST]")
  assert sum(prompt.loss_mask) == sum(prompt.loss_mask[: by_hand.index(2) + 1])


@needs_meta
def test_loss_mask_is_exactly_the_assistant_tokens_and_their_eos():
  tokenizer = Tokenizer(META_TOKENIZER)
  encoded = chat.encode_dialog(tokenizer, DIALOG)
  tokens, mask = np.asarray(encoded.tokens), np.asarray(encoded.loss_mask)
  spans, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    if not m and start is not None:
      spans.append(tokens[start:i].tolist())
      start = None
  assert len(spans) == 2
  for span, answer in zip(spans, (DIALOG[2]["content"], DIALOG[4]["content"])):
    assert span[-1] == tokenizer.eos_id
    assert tokenizer.decode(span[:-1]).strip() == answer
  assert mask[tokens == tokenizer.bos_id].sum() == 0


def test_special_tokens_in_user_text_stay_text(small_tokenizer):
  tokenizer = Tokenizer(small_tokenizer)
  encoded = chat.encode_dialog(
    tokenizer, [{"role": "user", "content": "</s><s>[INST] hi"}, {"role": "assistant", "content": "ok"}]
  )
  assert encoded.tokens.count(tokenizer.bos_id) == 1 and encoded.tokens.count(tokenizer.eos_id) == 1


@pytest.mark.parametrize(
  "messages,problem",
  [
    ([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}], "unknown role 'robot'"),
    ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}], "message 0 (user) has empty content"),
    (
      [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
      "does not end with an assistant turn",
    ),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}], "no assistant turn"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "turns must alternate"),
  ],
)
def test_bad_conversations_are_rejected(messages, problem):
  with pytest.raises(chat.ConversationError, match=problem.replace("(", r"\(").replace(")", r"\)")):
    chat.check_conversation(messages)


def write_jsonl(path, lines):
  path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
  return str(path)


def test_bad_lines_are_reported_with_file_and_line_then_skipped_or_stopped(tmp_path):
  good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
  path = write_jsonl(
    tmp_path / "sft.jsonl",
    [
      good,
      '{"messages": [',
      {"messages": [{"role": "boss", "content": "x"}]},
      {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]},
      {"messages": [{"role": "user", "content": "x"}]},
      good,
    ],
  )
  conversations, problems = chat_data.load_conversations([path], on_error="skip")
  assert len(conversations) == 2 and len(problems) == 4
  assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
  assert "malformed JSON" in problems[0] and "unknown role 'boss'" in problems[1]
  assert "empty content" in problems[2] and "no assistant turn" in problems[3]
  with pytest.raises(data.DataError, match=f"{path}:2: malformed JSON"):
    chat_data.load_conversations([path], on_error="stop")


def test_long_conversations_drop_the_oldest_exchanges_and_keep_the_last_answer(small_tokenizer):
  tokenizer = Tokenizer(small_tokenizer)
  messages = [{"role": "system", "content": "Be brief."}]
  for i in range(6):
    messages += [
      {"role": "user", "content": f"question number {i} " * 5},
      {"role": "assistant", "content": f"answer number {i} " * 5},
    ]
  full = chat.encode_dialog(tokenizer, messages)
  cut = chat.encode_dialog(tokenizer, messages, max_len=len(full.tokens) // 2)
  assert cut.dropped_exchanges >= 3 and len(cut.tokens) <= len(full.tokens) // 2
  assert cut.tokens[-sum(cut.loss_mask) :] == full.tokens[-sum(cut.loss_mask) :]  # the last answer is whole
  assert "Be brief" in tokenizer.decode(cut.tokens)  # the system prompt moves to the first exchange kept


def packed_model():
  cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)
  return cfg, Llama(cfg, rngs=nnx.Rngs(0))


def conversations_for_packing(tokenizer):
  rng = np.random.RandomState(0)
  words = "good morning my lord what news from the court".split()
  convs = []
  for n in (3, 5, 2, 4):
    convs.append(
      chat.encode_dialog(
        tokenizer,
        [
          {"role": "user", "content": " ".join(rng.choice(words, n))},
          {"role": "assistant", "content": " ".join(rng.choice(words, n + 2))},
        ],
      )
    )
  return convs


def test_packed_conversations_give_the_logits_and_gradients_they_give_alone(small_tokenizer):
  tokenizer = Tokenizer(small_tokenizer)
  cfg, model = packed_model()
  convs = conversations_for_packing(tokenizer)
  rows = chat_data.pack_conversations(convs, seq_len=sum(len(c.tokens) - 1 for c in convs) + 5)
  assert len(rows["inputs"]) == 1 and rows["segment_ids"].max() == 4  # all four share one row
  graphdef, params = nnx.split(model)
  packed = {k: jnp.asarray(v) for k, v in rows.items()}
  logits = np.asarray(model(packed["inputs"], packed["positions"], packed["segment_ids"]))

  def loss_sum(params, batch):
    losses, weights = token_losses(params, graphdef, batch)
    return jnp.sum(losses * weights)

  grad = jax.jit(jax.grad(loss_sum))
  packed_grads = grad(params, packed)
  alone_grads = None
  start = 0
  for conv in convs:
    alone = {k: jnp.asarray(v) for k, v in chat_data.pack_conversations([conv], seq_len=len(conv.tokens) - 1).items()}
    n = len(conv.tokens) - 1
    np.testing.assert_allclose(logits[0, start : start + n], np.asarray(model(alone["inputs"]))[0], atol=1e-5)
    g = grad(params, alone)
    alone_grads = g if alone_grads is None else jax.tree.map(jnp.add, alone_grads, g)
    start += n
  # The packed row's gradient is the sum of the conversations' own gradients: nothing flows across segments.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), packed_grads, alone_grads)


# ---------------------------------------------------------------------------------------------------------------------
# Through the CLI: pretrain → SFT → chat

MICRO = [
  "--config.model.vocab_size=512",
  "--config.model.dim=32",
  "--config.model.n_layers=2",
  "--config.model.n_heads=2",
  "--config.model.n_kv_heads=1",
  "--config.model.multiple_of=16",
  "--config.model.max_seq_len=128",
  "--config.train.seq_len=64",
  "--config.train.batch_size=4",
  "--config.train.warmup_steps=2",
  "--config.train.log_every=5",
  "--config.train.eval_batches=2",
]


def train_cli(config, workdir, *extra):
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.train", "--config", config, "--workdir", str(workdir), *MICRO, *extra],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.fixture(scope="module")
def sft_corpus(tmp_path_factory):
  rng = np.random.RandomState(1)
  greetings = ["hello", "good morning", "hi there", "well met", "good evening"]
  lines = []
  for i in range(120):
    g = greetings[i % len(greetings)]
    lines.append(
      {
        "messages": [
          {"role": "user", "content": f"{g}, how fare you? ({rng.randint(100)})"},
          {"role": "assistant", "content": f"{g} to you too, friend."},
        ]
      }
    )
  path = tmp_path_factory.mktemp("sft") / "chats.jsonl"
  return write_jsonl(path, lines + ['{"broken": ', {"messages": [{"role": "user", "content": "no answer"}]}])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, small_tokenizer, sft_corpus):
  if not os.path.isdir(os.path.dirname(small_tokenizer)):
    pytest.skip("no tokenizer")
  base = tmp_path_factory.mktemp("pipeline")
  pre = train_cli(
    "configs/tiny.py",
    base / "pre",
    f"--config.data.tokenizer={small_tokenizer}",
    "--config.data.sources=('shakespeare:sonnets',)",
    "--config.data.val_sources=('shakespeare:lovers_complaint',)",
    "--config.train.steps=10",
    "--config.train.eval_every=10",
  )
  assert pre.returncode == 0, pre.stderr[-3000:]
  sft = train_cli(
    "configs/tiny_sft.py",
    base / "sft",
    f"--config.init_from={base / 'pre'}",
    f"--config.data.sources=('{sft_corpus}',)",
    "--config.data.val_fraction=0.1",
    "--config.train.steps=40",
    "--config.train.lr=1e-2",
    "--config.train.eval_every=40",
  )
  assert sft.returncode == 0, sft.stderr[-3000:]
  return base, pre, sft


@needs_shakespeare
def test_sft_reports_skips_lowers_assistant_loss_and_starts_a_fresh_optimizer(pipeline):
  base, _, sft = pipeline
  assert "skipped 2 bad" in sft.stdout and f"init from {base / 'pre'}" in sft.stdout
  records = [json.loads(line) for line in open(base / "sft" / "metrics.jsonl")]
  losses = [r["loss"] for r in records if "loss" in r]
  assert losses[-1] < losses[0] - 1.0
  import orbax.checkpoint as ocp

  train_state = ocp.StandardCheckpointer().restore(str(base / "sft" / "checkpoints" / "40" / "train"))
  counts = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(train_state["opt_state"])
    if "count" in jax.tree_util.keystr(path)
  ]
  assert counts and all(int(c) == 40 for c in counts)  # 40 SFT steps, not 10 + 40: the optimizer started fresh


@needs_shakespeare
def test_chat_via_stdin_returns_a_reply_per_turn(pipeline):
  base, _, _ = pipeline
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "llama_jax.sample",
      "--checkpoint",
      str(base / "sft"),
      "--chat",
      "--system",
      "Be kind.",
      "--max_new_tokens",
      "16",
      "--temperature",
      "0",
    ],
    input="hello, how fare you?\ngood evening, how fare you?\n",
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  replies = result.stdout.strip().splitlines()
  assert len(replies) == 2 and all(r.strip() for r in replies), result.stdout
  assert "[INST]" not in result.stdout and "</s>" not in result.stdout


@needs_shakespeare
def test_init_from_another_model_shape_is_refused(pipeline, sft_corpus):
  base, _, _ = pipeline
  result = train_cli(
    "configs/tiny_sft.py",
    base / "sft_wrong",
    f"--config.init_from={base / 'pre'}",
    f"--config.data.sources=('{sft_corpus}',)",
    "--config.model.dim=64",
    "--config.train.steps=2",
  )
  assert result.returncode == 2
  assert "holds a different model (dim 32 → 64, hidden_dim 96 → 176)" in result.stderr.strip().splitlines()[-1]


def test_packaged_corpora_convert_to_conversations():
  chitchat = list(chat_data.iter_conversations(["chitchat"]))
  assert len(chitchat) > 5000
  good, problems = chat_data.load_conversations(["chatterbot:english,chinese"])
  assert len(good) > 500 and any("我" in m["content"] for _, c in good for m in c)
  assert all(c[-1]["role"] == "assistant" for _, c in good)
