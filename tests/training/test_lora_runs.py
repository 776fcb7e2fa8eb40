"""LoRA runs end to end: only the adapters train (base bit-identical, optimizer state of adapters only, checkpoints
of adapters plus lora.json), resume after SIGKILL is bit-exact, every command reads the workdir as the merged model,
exports (merged, peft) agree with peft on transformers, and bad settings are one line."""

from __future__ import annotations

import json
import os
import shutil
import signal

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.checkpoint import records
from llama_jax.core import model_config as model_config_lib
from llama_jax.core import paths
from llama_jax.core import run_config as run_config_lib
from llama_jax.inference import evaluation as evaluate_lib
from llama_jax.interop import hf
from llama_jax.interop import peft as peft_export
from llama_jax.model import lora as lora_lib
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from llama_jax.training.trainer import Trainer
from tests.conftest import needs_shakespeare
from tests.runs import (
  assert_bit_identical,
  assert_one_line_error,
  final_checkpoint,
  read_jsonl,
  run_module,
  run_train,
  train_in_process,
)

pytestmark = needs_shakespeare
LORA = ["--config.train.lora.rank=4", "--config.train.lora.alpha=8"]
GREEDY = ("--temperature", "0")


def lora_args(base) -> list[str]:
  return [f"--config.init_from={base}", *LORA]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_tokenizer):
  """A 4-step base run and an uninterrupted 12-step LoRA run on it."""
  root = tmp_path_factory.mktemp("lora")
  base = root / "base"
  run_train(base, small_tokenizer, "--config.train.steps=4")
  straight = root / "straight"
  result = run_train(straight, small_tokenizer, *lora_args(base))
  return base, straight, result


def test_a_lora_run_trains_only_the_adapters_and_saves_only_them(runs):
  base, straight, result = runs
  assert "LoRA rank 4" in result.stdout and "trainable" in result.stdout, result.stdout
  saved = final_checkpoint(straight, 12)
  names = {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(saved["params"])}
  assert names == {t + s for t in model_config_lib.LORA_TARGETS for s in (lora_lib.A_SUFFIX, lora_lib.B_SUFFIX)}
  # Adam's moments exist for the adapters only: two per adapter leaf, nothing shaped like a base weight.
  moments = [a for a in jax.tree.leaves(saved["train"]["opt_state"]) if a.ndim > 0]
  adapter_shapes = sorted(a.shape for a in jax.tree.leaves(saved["params"]))
  assert sorted(a.shape for a in moments) == sorted(adapter_shapes * 2)
  record = json.loads((straight / paths.LORA_FILE).read_text())
  assert record["base"] == str(base) and record["base_step"] == 4 and record["rank"] == 4
  b = saved["params"]["layers"]["mlp"]["w_down_lora_b"]
  assert np.abs(b).max() > 0  # B started at zeros and trained
  metrics = read_jsonl(straight / "metrics.jsonl")
  val = [m["val_loss"] for m in metrics if "val_loss" in m]
  assert val[0] == pytest.approx(read_jsonl(base / "metrics.jsonl")[-1]["val_loss"], abs=1e-4)  # step 0: the base
  assert val[-1] < val[0]


def test_the_frozen_base_is_bit_identical_after_steps_and_gets_no_gradient(runs):
  base, _, _ = runs
  cfg = run_config_lib.base_run_config()
  cfg.model.update(vocab_size=512, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, multiple_of=16, tie_embeddings=True)
  cfg.train.update(batch_size=4, seq_len=32, steps=3, warmup_steps=0, lr=1e-2)
  cfg.train.lora.rank = 2
  cfg.init_from = str(base)
  run_config = run_config_lib.run_config_from(cfg)
  trainer = Trainer(run_config.model, run_config, sharding.make_mesh(run_config.mesh, jax.devices()[:1]))
  trainer.load_frozen(str(base))
  before = jax.tree.map(np.array, trainer.frozen["base"])
  state = trainer.init_state()
  tokens = np.random.RandomState(0).randint(0, 512, (3, 4, 33)).astype(np.int32)
  for t in tokens:
    state, metrics = trainer.train_step(state, trainer.global_batch(dict(inputs=t[:, :-1], targets=t[:, 1:])))
  assert float(metrics["grad_norm"]) > 0
  assert_bit_identical(before, jax.tree.map(np.asarray, trainer.frozen["base"]))
  assert_bit_identical(before, checkpoint_params.load_params(str(base))[1])
  assert not lora_lib.split(state["params"])[0]  # the state's params hold no base leaf


def test_sigkill_then_rerun_is_bit_identical(runs, tmp_path, small_tokenizer):
  base, straight, _ = runs
  workdir = tmp_path / "killed"
  killed = run_train(
    workdir, small_tokenizer, *lora_args(base), check=False, module=("tests.fault_injection", "sigkill", "8")
  )
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = run_train(workdir, small_tokenizer, *lora_args(base))
  assert "steps 4 → 12" in resumed.stdout, resumed.stdout
  assert_bit_identical(final_checkpoint(straight, 12), final_checkpoint(workdir, 12))


def test_every_reader_sees_the_merged_model_and_exports_agree_with_peft(runs, tmp_path):
  base, straight, _ = runs
  merged = tmp_path / "merged"
  peft_export.merge_lora(str(straight), str(merged))
  settings = dict(sources=["shakespeare:lovers_complaint"], seq_len=32, batch_size=4, max_batches=2)
  # Bit for bit, by construction: both readers merge with the one merge (lora.merged_weight, the same compiled
  # program on the same device), so the merged checkpoint holds exactly the weights the LoRA workdir reads as.
  assert evaluate_lib.evaluate(str(straight), **settings) == evaluate_lib.evaluate(str(merged), **settings)
  sampled = [
    run_module(
      "llama_jax.sample", "--checkpoint", str(d), "--prompt", "To be", "--max_new_tokens", "6", "--temperature", "0"
    )
    for d in (straight, merged)
  ]
  assert sampled[0].returncode == 0, sampled[0].stderr[-2000:]
  assert sampled[0].stdout == sampled[1].stdout
  # HF exports: the merged weights, and the base plus a peft adapter, give the same logits as llama_jax.
  hf.to_hf(str(straight), str(tmp_path / "hf_merged"))
  hf.to_hf(str(base), str(tmp_path / "hf_base"))
  peft_export.to_peft(str(straight), str(tmp_path / "adapter"))
  tokens = torch.tensor(np.random.RandomState(0).randint(0, 512, (2, 16)))
  with torch.no_grad():
    merged_hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_merged").eval()
    base_hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    with_adapter = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
    want = merged_hf(tokens).logits.numpy()
    np.testing.assert_allclose(with_adapter(tokens).logits.numpy(), want, atol=1e-5)
  cfg, params = checkpoint_params.load_params(str(straight))
  ours = nnx.merge(sharding.abstract_model(Llama, cfg)[0], jax.tree.map(np.asarray, params))
  np.testing.assert_allclose(np.asarray(ours(tokens.numpy())), want, atol=1e-5)


def test_lora_needs_a_base_and_a_resume_keeps_its_settings(runs, tmp_path, small_tokenizer, capfd):
  base, straight, _ = runs
  no_base = train_in_process(capfd, tmp_path / "no_base", small_tokenizer, *LORA)
  assert_one_line_error(no_base, "train.lora.rank 4 adapts a trained model: set init_from")
  too_big = train_in_process(
    capfd, tmp_path / "big", small_tokenizer, f"--config.init_from={base}", "--config.train.lora.rank=33"
  )
  assert_one_line_error(too_big, "train.lora.rank must be in [1, model.dim=32]")
  copy = tmp_path / "copy"
  shutil.copytree(straight, copy)
  changed = train_in_process(capfd, copy, small_tokenizer, f"--config.init_from={base}", "--config.train.lora.rank=8")
  assert_one_line_error(changed, "holds adapters of rank 4", "use a new --workdir")


def test_a_changed_base_is_refused_by_every_reader(runs, tmp_path, small_tokenizer, capfd):
  base, straight, _ = runs
  moved_base, workdir = tmp_path / "base", tmp_path / "lora"
  shutil.copytree(base, moved_base)
  shutil.copytree(straight, workdir)
  record = json.loads((workdir / paths.LORA_FILE).read_text())
  (workdir / paths.LORA_FILE).write_text(json.dumps(dict(record, base=str(moved_base))))
  cfg, params = checkpoint_params.load_params(str(workdir))  # the copy reads as before
  # Another model saved under the same path and step: intact files, but not the base the adapters were trained on.
  cfg, base_params = checkpoint_params.load_params(str(moved_base))
  shutil.rmtree(moved_base)
  changed = jax.tree.map(lambda a: np.asarray(a) + np.float32(1e-3), base_params)
  checkpoint_params.save_params_dir(str(moved_base), cfg, changed, step=4, tokenizer_path=str(base / "tokenizer.model"))
  for read in (
    lambda: checkpoint_params.load_params(str(workdir)),  # sample, evaluate, serve
    lambda: peft_export.merge_lora(str(workdir), str(tmp_path / "m")),
    lambda: peft_export.to_peft(str(workdir), str(tmp_path / "p")),
  ):
    with pytest.raises(records.LoraError, match="adapts step 4 of .* whose files have changed since"):
      read()
  resumed = train_in_process(capfd, workdir, small_tokenizer, f"--config.init_from={moved_base}", *LORA)
  assert_one_line_error(resumed, "adapts step 4 of", "whose files have changed since")
  assert not os.path.exists(tmp_path / "m") and not os.path.exists(tmp_path / "p")
