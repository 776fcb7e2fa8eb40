"""HF ↔ llama_jax conversion: bit-exact round trips, logits parity through the checkpoint, and CLI errors."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from llama_jax import checkpoint, convert
from llama_jax.config import ModelConfig
from llama_jax.model import Llama
from tests import hf_utils
from tests.conftest import META_TOKENIZER as TOKENIZER_FIXTURE
from tests.conftest import ROOT, needs_meta_tokenizer

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)


def save_hf(tmp_path, cfg=CFG, dtype=torch.float32, **save_kwargs):
  model = hf_utils.random_hf_model(cfg).to(dtype)
  hf_dir = str(tmp_path / "hf")
  model.save_pretrained(hf_dir, **save_kwargs)
  return model, hf_dir


def all_safetensors(directory):
  tensors = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(directory, name)))
  return tensors


@pytest.mark.parametrize(
  "dtype,sharded,tied",
  [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.float32, False, True)],
  ids=["f32", "bf16_sharded", "tied"],
)
def test_hf_to_llama_jax_to_hf_is_bit_identical(tmp_path, dtype, sharded, tied):
  cfg = CFG.replace(tie_embeddings=tied)
  _, hf_dir = save_hf(tmp_path, cfg, dtype, **({"max_shard_size": "100KB"} if sharded else {}))
  if sharded:
    assert os.path.isfile(os.path.join(hf_dir, convert.INDEX_FILE))
  assert convert.main(["--from_hf", hf_dir, "--out", str(tmp_path / "ckpt")]) == 0
  assert convert.main(["--to_hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
  original, back = all_safetensors(hf_dir), all_safetensors(str(tmp_path / "back"))
  if tied:
    original.pop("lm_head.weight", None)
  assert sorted(back) == sorted(original)
  for name, tensor in original.items():
    assert back[name].dtype == tensor.dtype, name
    np.testing.assert_array_equal(
      back[name].view(np.uint16 if tensor.itemsize == 2 else np.uint32),
      tensor.view(np.uint16 if tensor.itemsize == 2 else np.uint32),
      err_msg=name,
    )


def test_converted_checkpoint_gives_hf_logits_and_exports_a_dir_transformers_loads(tmp_path):
  hf_model, hf_dir = save_hf(tmp_path)
  convert.from_hf(hf_dir, str(tmp_path / "ckpt"))
  cfg, params = checkpoint.load_params(str(tmp_path / "ckpt"))
  # HF states the MLP width outright, so the converted config carries it as ffn_hidden_dim.
  assert cfg == CFG.replace(norm_eps=hf_model.config.rms_norm_eps, ffn_hidden_dim=CFG.hidden_dim, multiple_of=256)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
  expected = hf_model(torch.tensor(tokens)).logits.detach().numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), expected, atol=1e-4, rtol=0)

  convert.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
  reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager").eval()
  np.testing.assert_array_equal(reloaded(torch.tensor(tokens)).logits.detach().numpy(), expected)


@needs_meta_tokenizer  # skips without the fixture, fails under CI=true
def test_tokenizer_model_travels_with_the_checkpoint(tmp_path):
  _, hf_dir = save_hf(tmp_path)
  with open(TOKENIZER_FIXTURE, "rb") as src, open(os.path.join(hf_dir, "tokenizer.model"), "wb") as dst:
    dst.write(src.read())
  convert.from_hf(hf_dir, str(tmp_path / "ckpt"))
  convert.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
  for directory in ("ckpt", "back"):
    with open(tmp_path / directory / "tokenizer.model", "rb") as f, open(TOKENIZER_FIXTURE, "rb") as g:
      assert f.read() == g.read()


def test_llama3_rope_scaling_survives_conversion(tmp_path):
  cfg = CFG.replace(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=64)
  _, hf_dir = save_hf(tmp_path, cfg)
  converted = convert.from_hf(hf_dir, str(tmp_path / "ckpt"))
  assert (
    converted.rope_scaling,
    converted.rope_scaling_factor,
    converted.rope_original_max_len,
    converted.rope_theta,
  ) == ("llama3", 8.0, 64, 500000.0)


def test_meta_interleaved_qk_permutation_turns_pair_rotation_into_half_rotation():
  """Meta rotates pairs (x0,x1),(x2,x3)...; after permute_meta_qk, the half-split rotation gives the same q·k."""
  from llama_jax.model import RotaryEmbedding

  n_heads, head_dim, dim = 2, 8, 16
  rng = np.random.RandomState(0)
  w_meta = rng.randn(n_heads * head_dim, dim).astype(np.float32)
  x = rng.randn(5, dim).astype(np.float32)
  positions = np.arange(5)
  inv_freq = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
  angles = positions[:, None] * inv_freq  # [T, H/2]
  # Meta's reference: complex multiplication of consecutive pairs.
  q = (x @ w_meta.T).reshape(5, n_heads, head_dim // 2, 2)
  q_complex = (q[..., 0] + 1j * q[..., 1]) * np.exp(1j * angles)[:, None, :]
  meta_rotated = np.stack([q_complex.real, q_complex.imag], -1).reshape(5, n_heads, head_dim)
  # Ours: permuted weights, half-split rotation; the same features in the half-split order.
  cfg = ModelConfig(vocab_size=8, dim=dim, n_layers=1, n_heads=n_heads, multiple_of=8)
  q_ours = (x @ convert.permute_meta_qk(w_meta, n_heads).T).reshape(1, 5, n_heads, head_dim)
  ours = np.asarray(RotaryEmbedding(cfg)(jnp.asarray(q_ours), jnp.asarray(positions[None])))[0]
  half_order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
  np.testing.assert_allclose(ours, meta_rotated[..., half_order], atol=1e-5)


def run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.convert", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
  )


def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for fragment in fragments:
    assert fragment in lines[0]


def test_cli_missing_dir(tmp_path):
  assert_one_line_error(
    run_cli("--from_hf", str(tmp_path / "nope"), "--out", str(tmp_path / "out")), "does not exist", "nope"
  )
  assert not (tmp_path / "out").exists()


def test_cli_dir_without_safetensors(tmp_path):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(convert.hf_config_from_model_config(CFG)))
  assert_one_line_error(run_cli("--from_hf", str(hf_dir), "--out", str(tmp_path / "out")), "no *.safetensors")


def test_cli_mismatched_shapes(tmp_path):
  _, hf_dir = save_hf(tmp_path)
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["intermediate_size"] = 96
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(hf_config, f)
  assert_one_line_error(
    run_cli("--from_hf", hf_dir, "--out", str(tmp_path / "out")), "model.layers.0.mlp.gate_proj.weight", "(96, 64)"
  )


def test_cli_refuses_to_overwrite_a_non_empty_output(tmp_path):
  _, hf_dir = save_hf(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  (out / "precious.txt").write_text("keep me")
  assert_one_line_error(run_cli("--from_hf", hf_dir, "--out", str(out)), "not empty")
  assert (out / "precious.txt").read_text() == "keep me"


def test_cli_to_hf_from_an_incomplete_checkpoint(tmp_path):
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / checkpoint.CONFIG_FILE).write_text(CFG.to_json())
  assert_one_line_error(
    run_cli("--to_hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")), "no complete checkpoint step"
  )


ROPE_SCALINGS = {
  "linear": (
    dict(rope_scaling="linear", rope_scaling_factor=4.0),
    {"rope_type": "linear", "factor": 4.0},
  ),
  "llama3": (
    dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=32),
    {
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32,
    },
  ),
}


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_to_hf_writes_rope_scaling_and_transformers_gives_the_same_logits(tmp_path, scaling):
  """A rope-scaled llama_jax checkpoint exported with to_hf: config.json carries `rope_scaling` as transformers
  names it, and the LlamaForCausalLM that transformers builds from the directory gives llama_jax's logits (float32,
  1e-4 as the README states) at 64 tokens, past llama3's 32-token original context. Without the scaling the
  logits move by 5e-3 (llama3) to 8e-3 (linear), checked below, so the comparison cannot pass with it dropped."""
  changes, expected_rope_scaling = ROPE_SCALINGS[scaling]
  cfg = CFG.replace(**changes)
  params = hf_utils.params_of(hf_utils.random_hf_model(cfg, seed=3), cfg)  # only the weights: no rope in them
  checkpoint.save_params_dir(str(tmp_path / "ckpt"), cfg, params)
  convert.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))

  with open(tmp_path / "hf" / "config.json") as f:
    assert json.load(f)["rope_scaling"] == expected_rope_scaling

  # Built abstractly and filled with the weights: the random initialisation would only be overwritten.
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  tokens = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 64))
  ours = np.asarray(model(jnp.asarray(tokens)))
  exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
  with torch.no_grad():
    hf_logits = exported(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(hf_logits, ours, atol=1e-4, rtol=0)

  unscaled = nnx.eval_shape(lambda: Llama(cfg.replace(rope_scaling="none"), rngs=nnx.Rngs(0)))
  nnx.update(unscaled, state)
  scaling_effect = np.abs(np.asarray(unscaled(jnp.asarray(tokens))) - ours).max()
  print(f"{scaling}: logits move by {scaling_effect:.1e} without the scaling")
  assert scaling_effect > 1e-3
