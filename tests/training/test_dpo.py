"""DPO: the loss and its gradient against a torch reference of the formula on HF LlamaForCausalLM log-probs, the step-0
values (log 2, accuracy 0.5), bad preference lines, the prepared rows, and the pair set built from shipped data.

Tolerance: ours in float32 against the torch formula in float64 on the same weights, 1e-5 absolute on the loss and on
every gradient entry. The margin is a difference of four sums of ~10 token log-probs of ~-5.5 each, so float32
rounding alone is ~1e-6 there: measured, ours is 7e-7 from float64 on the loss and 4e-6 on the gradients (largest
entry 1.2); torch's own float32 run of the same formula is 7e-6 off on the loss, too close to the bound to be the
reference.
"""

import copy
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llama_jax import preference_data as preference_data_lib
from llama_jax.core.model_config import ModelConfig
from llama_jax.data import chat_template as chat
from llama_jax.data import preference, sft
from llama_jax.data.sources import DataError
from llama_jax.data.tokenization import Tokenizer
from llama_jax.interop import hf as convert
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.model.loss import dpo_eval_step, dpo_losses, sequence_logps, summarize_dpo
from tests import hf_utils

torch.set_num_threads(2)
TOL = 1e-5
BETA = 0.5  # large enough that σ is far from its value at 0 for the perturbed policy: the test sees the curvature


def small_config() -> ModelConfig:
  return ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)


def pair_batch(cfg, pairs=3, length=20, seed=0) -> dict[str, np.ndarray]:
  """Random pairs in the prepared layout: a shared prompt, responses of different lengths weighted 1, right padding;
  plus one all-padding pair (weight 0), as eval_batches pads, which must count nothing."""
  rng = np.random.RandomState(seed)
  batch = {
    k: np.zeros((pairs + 1, length), np.float32 if k.endswith("weights") else np.int32)
    for k in preference.PREFERENCE_KEYS
  }
  for r in range(pairs):
    prompt = rng.randint(1, cfg.vocab_size, rng.randint(3, 8))
    for side in preference.SIDES:
      response = rng.randint(1, cfg.vocab_size, rng.randint(2, length - len(prompt)))
      tokens = np.concatenate([prompt, response])
      n = len(tokens) - 1
      batch[f"{side}_inputs"][r, :n] = tokens[:-1]
      batch[f"{side}_targets"][r, :n] = tokens[1:]
      batch[f"{side}_weights"][r, len(prompt) - 1 : n] = 1.0
  return batch


def torch_dpo(policy, reference, batch, beta):
  """The formula written out in torch (float64) from HF log-probs: -log σ(β((π_w − π_l) − (ref_w − ref_l))) summed over
  pairs with a weighted token, and the gradient with respect to the policy's weights."""

  policy, reference = copy.deepcopy(policy).double(), copy.deepcopy(reference).double()

  def logps(model, side):
    logits = model(torch.tensor(batch[f"{side}_inputs"], dtype=torch.long)).logits
    token_logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(batch[f"{side}_targets"])[..., None].long())
    return (token_logps[..., 0] * torch.tensor(batch[f"{side}_weights"], dtype=torch.float64)).sum(-1)

  with torch.no_grad():
    ref_w, ref_l = logps(reference, "chosen"), logps(reference, "rejected")
  pi_w, pi_l = logps(policy, "chosen"), logps(policy, "rejected")
  valid = torch.tensor(batch["chosen_weights"].sum(-1) > 0, dtype=torch.float64)
  loss = -(F.logsigmoid(beta * ((pi_w - pi_l) - (ref_w - ref_l))) * valid).sum()
  policy.zero_grad()
  loss.backward()
  grads = {name: p.grad.numpy().copy() for name, p in policy.named_parameters()}
  rewards = (beta * (pi_w - ref_w)).detach().numpy(), (beta * (pi_l - ref_l)).detach().numpy()
  return loss.item(), grads, rewards


@pytest.fixture(scope="module")
def models():
  cfg = small_config()
  reference = hf_utils.random_hf_model(cfg, seed=0)
  policy = hf_utils.random_hf_model(cfg, seed=0)
  torch.manual_seed(1)
  with torch.no_grad():
    for p in policy.parameters():  # policy ≠ reference, as after some training
      p.add_(0.05 * p.abs().mean() * torch.randn_like(p))
  graphdef, _ = sharding.abstract_params(Llama, cfg)
  as_jax = lambda model: jax.tree.map(jnp.asarray, hf_utils.params_of(model, cfg))  # noqa: E731
  return cfg, graphdef, (policy, as_jax(policy)), (reference, as_jax(reference))


def test_dpo_loss_and_gradient_match_a_torch_reference_on_hf_log_probs(models):
  cfg, graphdef, (hf_policy, policy), (hf_reference, reference) = models
  batch = pair_batch(cfg)
  expected_loss, hf_grads, (expected_chosen, expected_rejected) = torch_dpo(hf_policy, hf_reference, batch, BETA)

  def loss_fn(params):
    loss_sum, pairs, metrics = dpo_losses(
      params, graphdef, {k: jnp.asarray(v) for k, v in batch.items()}, beta=BETA, reference_params=reference
    )
    return loss_sum, (pairs, metrics)

  (loss_sum, (pairs, metrics)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(policy)
  assert float(pairs) == 3  # the padding pair is not counted
  assert abs(float(loss_sum) - expected_loss) <= TOL, (float(loss_sum), expected_loss)
  assert abs(float(metrics["reward_chosen"]) - expected_chosen[:3].sum()) <= TOL
  assert abs(float(metrics["reward_rejected"]) - expected_rejected[:3].sum()) <= TOL
  # A count decided per pair on two sides (float32 here, float64 in torch): exact once no margin is within TOL of 0.
  assert np.min(np.abs(expected_chosen[:3] - expected_rejected[:3])) > 10 * TOL
  expected_accuracy = float(np.sum(expected_chosen[:3] > expected_rejected[:3]))
  assert float(metrics["reward_accuracy"]) == expected_accuracy
  # Torch's gradients are in HF's layout; the converter's map to ours is a permutation and transposes (linear), so
  # it carries gradients as it carries weights.
  expected_grads = convert.params_from_hf(hf_grads, cfg)
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), grads, expected_grads)
  scale = max(jax.tree.leaves(jax.tree.map(lambda b: float(np.max(np.abs(b))), expected_grads)))
  worst = max(jax.tree.leaves(diffs))
  print(f"loss {float(loss_sum):.6f} vs {expected_loss:.6f}; max grad diff {worst:.2e} (largest grad {scale:.2e})")
  assert scale > 1e-2  # a gradient that is there to compare
  assert worst <= TOL


def test_at_step_0_policy_equal_to_reference_the_loss_is_log_2_and_accuracy_one_half(models):
  cfg, graphdef, _, (_, reference) = models
  batch = {k: jnp.asarray(v) for k, v in pair_batch(cfg, seed=1).items()}
  # The trainer's step 0: the reference is a frozen *copy* of the initial parameters, inside one jit.
  copy = jax.tree.map(jnp.copy, reference)
  step = jax.jit(lambda p, b, r: dpo_eval_step(p, b, graphdef=graphdef, beta=0.1, reference_params=r))
  sums = {k: float(v) for k, v in step(reference, batch, copy).items()}
  assert sums["pairs"] == 3
  assert sums["reward_chosen"] == sums["reward_rejected"] == sums["margin"] == 0.0
  means = summarize_dpo(sums)
  assert means["loss"] == pytest.approx(math.log(2), abs=1e-7)
  assert means["reward_accuracy"] == 0.5  # every pair ties, and a tie counts one half
  # The log-probs themselves are not zero: the zero rewards come from policy = reference, not from empty weights.
  logps = sequence_logps(reference, graphdef, batch["chosen_inputs"], batch["chosen_targets"], batch["chosen_weights"])
  assert np.all(np.asarray(logps[:3]) < -1.0) and float(logps[3]) == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Data


def write_jsonl(path, lines):
  path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
  return str(path)


GOOD = {"prompt": "What news from the court?", "chosen": "The king is well.", "rejected": "I like turnips."}


def test_bad_preference_lines_are_reported_with_file_and_line_then_skipped_or_stopped(tmp_path):
  path = write_jsonl(
    tmp_path / "pairs.jsonl",
    [
      GOOD,
      {"prompt": "hello", "chosen": "hi"},
      {"prompt": "hello", "chosen": "hi", "rejected": "  "},
      {"prompt": "hello", "chosen": "hi there", "rejected": " hi there "},
      '{"prompt": "hello", ',
      {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], **GOOD},
      {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "chosen": "a",
        "rejected": "b",
      },
      {"chosen": "a", "rejected": "b"},
      {"prompt": "q", "chosen": 3, "rejected": "b"},
      {**GOOD, "id": 7},
    ],
  )
  pairs, problems = preference.load_pairs([path], on_error="skip")
  assert [p.location for p in pairs] == [f"{path}:1", f"{path}:10"]
  assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in range(2, 10)]
  what = [p.split(": ", 1)[1] for p in problems]
  assert what[0] == "missing field 'rejected'"
  assert what[1] == "empty 'rejected' response"
  assert what[2].startswith("identical 'chosen' and 'rejected' responses")
  assert what[3].startswith("malformed JSON")
  assert what[4] == "has both 'prompt' and 'messages'; give one"
  assert what[5] == "bad 'messages': a prompt must end with a user turn"
  assert what[6] == "missing field 'prompt' (or 'messages')"
  assert what[7] == "field 'chosen' must be a string, got int"
  with pytest.raises(DataError, match=f"^{path}:2: missing field 'rejected'$"):
    preference.load_pairs([path], on_error="stop")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_tokenizer):
  base = tmp_path_factory.mktemp("preference")
  rng = np.random.RandomState(0)
  words = "good morning my lord what news from the court king queen".split()
  lines = []
  for i in range(40):
    line = {
      "chosen": " ".join(rng.choice(words, rng.randint(2, 6))) + f" {i}",
      "rejected": " ".join(rng.choice(words, rng.randint(2, 9))) + f" no {i}",
    }
    if i % 2:
      line["prompt"] = f"question {i}: " + " ".join(rng.choice(words, 4))
    else:  # a conversation: its earlier assistant turn must get no weight
      line["messages"] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello " * (1 + i % 5)},
        {"role": "assistant", "content": "an earlier answer"},
        {"role": "user", "content": f"and then {i}?"},
      ]
    lines.append(line)
  lines.append({"prompt": "tell me everything " * 40, "chosen": "No.", "rejected": "Yes."})  # line 41: too long
  lines.append({"prompt": "hi", "chosen": "same", "rejected": "same"})  # line 42: bad
  path = write_jsonl(base / "pairs.jsonl", lines)
  tokenizer = Tokenizer(small_tokenizer)
  out = str(base / "data")
  kwargs = dict(seq_len=128, val_fraction=0.2, seed=0)
  meta = preference.prepare_preference([path], tokenizer, out, **kwargs)
  return path, tokenizer, out, meta, kwargs


def test_prepared_rows_weight_only_the_responses_and_share_the_prompt(prepared):
  path, tokenizer, out, meta, _ = prepared
  assert meta["skipped"] == 2 and meta["too_long"] == 1
  assert meta["skipped_examples"][0].startswith(f"{path}:42: identical")
  assert meta["skipped_examples"][1].startswith(f"{path}:41: prompt too long to leave room for a response")
  assert meta["train"]["pairs"] + meta["val"]["pairs"] == 40 and meta["val"]["pairs"] > 0
  pairs = {p.location: p for p in preference.load_pairs([path])[0]}
  rows = [preference.PreferenceRows(out, split) for split in ("train", "val")]
  checked = 0
  for split_rows in rows:
    for r in range(len(split_rows)):
      row = split_rows[r]
      weights = {side: row[f"{side}_weights"] for side in preference.SIDES}
      responses = {}
      for side in preference.SIDES:
        targets, w = row[f"{side}_targets"], weights[side]
        assert set(np.unique(w)) == {0.0, 1.0}
        span = np.flatnonzero(w)
        assert np.all(np.diff(span) == 1)  # one contiguous span: the last response only
        assert targets[span[-1]] == tokenizer.eos_id and np.all(w[span[-1] + 1 :] == 0)
        responses[side] = tokenizer.decode(targets[span[:-1]].tolist()).strip()
        start = span[0]
        assert np.all(row[f"{side}_inputs"][span[-1] + 1 :] == 0)  # right padding
      pair = next(p for p in pairs.values() if (p.chosen, p.rejected) == (responses["chosen"], responses["rejected"]))
      # The prompt tokens (every input before the response) are the same on both sides.
      n_prompt = np.flatnonzero(weights["chosen"])[0]
      assert n_prompt == np.flatnonzero(weights["rejected"])[0] == start
      np.testing.assert_array_equal(row["chosen_inputs"][: n_prompt + 1], row["rejected_inputs"][: n_prompt + 1])
      prompt_text = tokenizer.decode(row["chosen_inputs"][: n_prompt + 1].tolist())
      assert pair.messages[-1]["content"].strip() in prompt_text and "[/INST]" in prompt_text
      if len(pair.messages) > 1 and "hello" in prompt_text:  # the earlier exchange was kept
        assert "an earlier answer" in prompt_text  # in the prompt, with no weight
      checked += 1
  assert checked == 40


def test_prepared_pairs_are_reused_split_by_location_and_batched(prepared):
  path, tokenizer, out, meta, kwargs = prepared
  again = preference.prepare_preference([path], tokenizer, out, **kwargs)
  assert again == meta  # reused: the same fingerprint, the shards pass their checks
  # "stop" stops at the first bad line (42 fails its check on reading); without it, at the pair too long (41).
  with pytest.raises(DataError, match=f"^{path}:42: identical"):
    preference.prepare_preference([path], tokenizer, out + "_stop", on_error="stop", **kwargs)
  first_41 = path[: -len(".jsonl")] + "_41.jsonl"
  with open(path) as f, open(first_41, "w") as g:
    g.writelines(f.readlines()[:41])
  with pytest.raises(DataError, match=f"^{first_41}:41: prompt too long to leave room for a response"):
    preference.prepare_preference([first_41], tokenizer, out + "_stop", on_error="stop", **kwargs)
  dataset = preference.preference_train_dataset(out, global_batch=4, seed=0)
  batch = dataset[0]
  assert set(batch) == set(preference.PREFERENCE_KEYS)
  assert all(v.shape == (4, 128) for v in batch.values())
  assert batch["chosen_inputs"].dtype == np.int32 and batch["chosen_weights"].dtype == np.float32


def test_validation_pairs_evaluate_to_sums(prepared):
  """Held-out pairs through dpo_eval_step with padding rows appended (as eval_batches pads): they count no pair."""
  _, tokenizer, out, meta, _ = prepared
  cfg = ModelConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=128)
  graphdef, abstract = sharding.abstract_params(Llama, cfg)
  rng = np.random.RandomState(0)  # random weights without an init to compile
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape).astype(a.dtype)), abstract)
  rows = preference.PreferenceRows(out, "val")
  step = jax.jit(lambda p, b: dpo_eval_step(p, b, graphdef=graphdef, beta=0.1, reference_params=p))
  padded = {k: np.concatenate([np.asarray(v), np.zeros((3, v.shape[1]), v.dtype)]) for k, v in rows.arrays.items()}
  sums = {k: float(v) for k, v in step(params, padded).items()}
  assert sums["pairs"] == meta["val"]["pairs"]
  assert summarize_dpo(sums)["loss"] == pytest.approx(math.log(2), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# The shipped pair set


def test_shipped_pairs_are_deterministic_and_never_pair_an_answer_with_itself(tmp_path):
  records = preference.build_pairs(["chitchat"])
  assert records == preference.build_pairs(["chitchat"])
  assert records != preference.build_pairs(["chitchat"], seed=1)
  conversations = dict(sft.load_conversations(["chitchat"])[0])
  assert len(records) == len(conversations) == 4009
  answers = {}
  for record in records:
    assert record["rejected"].strip().casefold() != record["chosen"].strip().casefold()
    messages = conversations[record["source"]]
    # chosen is the real answer to the prompt: the turn that follows the prompt in its conversation
    n = len(record["messages"])
    k = next(i for i in range(0, len(messages), 2) if messages[max(0, i - 2) : i + 1] == record["messages"])
    assert n <= 3 and messages[k + 1]["content"] == record["chosen"]
    answers[record["source"]] = record["chosen"]
  # each rejected answer is another conversation's chosen one, about as often rejected as chosen
  chosen_counts = {}
  for record in records:
    chosen_counts[record["chosen"]] = chosen_counts.get(record["chosen"], 0) + 1
  rejected_counts = {}
  for record in records:
    rejected_counts[record["rejected"]] = rejected_counts.get(record["rejected"], 0) + 1
  assert set(rejected_counts) <= set(chosen_counts)
  assert sum(abs(rejected_counts.get(a, 0) - c) for a, c in chosen_counts.items()) <= len(records) // 100
  # same-text answers (greetings) are never paired, even from different conversations
  path = write_jsonl(
    tmp_path / "chats.jsonl",
    [
      {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "Hi" if i < 3 else f"a{i}"}]}
      for i in range(6)
    ],
  )
  small = preference.build_pairs([path])
  assert all(r["chosen"].casefold() != r["rejected"].casefold() for r in small) and len(small) == 6
  out = tmp_path / "pairs.jsonl"
  preference_data_lib.main(["build", "--out", str(out), "--sources", path])
  assert [json.loads(line) for line in out.read_text().splitlines()] == small
  pairs, problems = preference.load_pairs([str(out)])
  assert len(pairs) == 6 and not problems
  assert [p.chosen for p in preference.load_pairs([f"pairs:{path}"])[0]] == [r["chosen"] for r in small]


def test_encoded_pair_cut_keeps_the_same_prompt_on_both_sides(small_tokenizer):
  tokenizer = Tokenizer(small_tokenizer)
  messages = []
  for i in range(6):
    messages += [
      {"role": "user", "content": f"question {i} " * 4},
      {"role": "assistant", "content": f"answer {i} " * 4},
    ]
  messages.append({"role": "user", "content": "last?"})
  pair = preference.PreferencePair("x", tuple(messages), "short", "a much longer rejected answer " * 3)
  encoded = preference.encode_pair(tokenizer, pair, max_len=80)
  assert encoded.dropped_exchanges > 0
  assert len(encoded.rejected_tokens) <= 80 and len(encoded.chosen_tokens) < len(encoded.rejected_tokens)
  n = len(encoded.chosen_tokens) - sum(encoded.chosen_weights)
  assert encoded.chosen_tokens[:n] == encoded.rejected_tokens[:n]
  full = chat.encode_dialog(tokenizer, [*messages, {"role": "assistant", "content": "short"}])
  assert encoded.chosen_tokens[n:] == full.tokens[len(full.tokens) - sum(encoded.chosen_weights) :]
