"""convert refuses what it cannot convert faithfully: a stored tensor the config does not account for, a tensor the
config implies but no file holds, and every malformed input (config.json, the index, safetensors headers and data,
params.json, .pth shards). Each is one line on stderr starting with ``error:``, exit status 2, and nothing left behind:
no output directory and no scratch directory beside it."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from llama_jax import convert as convert_lib
from llama_jax.checkpoint import digests
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.interop import safetensors_stream
from llama_jax.interop import safetensors_stream as safetensors_stream_lib
from tests import hf_utils
from tests.interop.test_convert import META_CFG, assert_one_line_error, run_cli, write_meta_dir

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """HF directories written once by transformers' save_pretrained (random weights, offline): untied (its lm_head
  differs from the embedding), tied (no lm_head stored) and sharded into several files with an index."""
  root = tmp_path_factory.mktemp("saved")
  dirs = {}
  for kind, cfg, kwargs in [
    ("untied", CFG, {}),
    ("tied", CFG.replace(tie_embeddings=True), {}),
    ("sharded", CFG, {"max_shard_size": "100KB"}),
  ]:
    dirs[kind] = str(root / kind)
    hf_utils.random_hf_model(cfg, seed=len(dirs)).save_pretrained(dirs[kind], **kwargs)
  assert os.path.isfile(os.path.join(dirs["sharded"], safetensors_stream_lib.INDEX_FILE))
  return dirs


@pytest.fixture(scope="module")
def saved_meta(tmp_path_factory):
  """Meta's download of a random model in two model-parallel shards, written once."""
  meta_dir = tmp_path_factory.mktemp("saved_meta") / "meta"
  return write_meta_dir(hf_utils.random_hf_model(META_CFG), META_CFG, meta_dir)


def copy_of(source, tmp_path, name="hf"):
  return shutil.copytree(source, str(tmp_path / name))


def edit_json(path, edit):
  """Rewrites a JSON file with edit(value), or with the text `edit` as it is."""
  with open(path) as f:
    value = json.load(f)
  with open(path, "w") as f:
    f.write(edit if isinstance(edit, str) else json.dumps(edit(value)))


def edit_tensors(path, edit):
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def convert_error(capsys, tmp_path, *args):
  """The one-line error of ``convert.main([*args, --out tmp_path/out])``, run in-process (main → run_or_exit →
  exit status 2), checked to leave tmp_path as it was: no output directory, no scratch directory."""
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(SystemExit) as exit_info:
    convert_lib.main([*args, "--out", str(tmp_path / "out")])
  assert exit_info.value.code == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
  assert captured.out == ""
  assert sorted(os.listdir(tmp_path)) == before
  return lines[0]


def assert_names(line, *fragments):
  for fragment in fragments:
    assert fragment in line, (fragment, line)


# ---------------------------------------------------------------------------------------------------------------------
# Stored tensors against the config


def test_a_stored_layer_past_num_hidden_layers_is_refused(tmp_path, capsys, saved):
  """The user's case: config.json says 1 layer over 2 stored; it used to convert one and drop the other."""
  hf_dir = copy_of(saved["untied"], tmp_path)
  edit_json(os.path.join(hf_dir, "config.json"), lambda c: {**c, "num_hidden_layers": 1})
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, "'model.layers.1.", os.path.join(hf_dir, WEIGHTS), "num_hidden_layers=1", "more layers")


def test_a_missing_layer_tensor_is_refused(tmp_path, capsys, saved):
  hf_dir = copy_of(saved["untied"], tmp_path)
  edit_tensors(os.path.join(hf_dir, WEIGHTS), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, "'model.layers.1.mlp.up_proj.weight' is missing from", os.path.join(hf_dir, WEIGHTS))


def test_a_distinct_lm_head_under_a_tied_config_is_refused(tmp_path, capsys, saved):
  """The user's case: tie_word_embeddings=true over a stored lm_head that differs from the embedding (it used to be
  dropped); the message gives the largest difference."""
  hf_dir = copy_of(saved["untied"], tmp_path)
  edit_json(os.path.join(hf_dir, "config.json"), lambda c: {**c, "tie_word_embeddings": True})
  tensors = load_file(os.path.join(hf_dir, WEIGHTS))
  worst = np.abs(tensors["lm_head.weight"] - tensors["model.embed_tokens.weight"]).max()
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, "lm_head.weight", os.path.join(hf_dir, WEIGHTS), "tie_word_embeddings=true", f"{worst:.3g}")


def test_an_lm_head_equal_to_the_embedding_under_a_tied_config_converts(tmp_path, saved):
  """Some exporters store the tied head as well: equal to the embedding it is the embedding, and converts (as do the
  rotary inv_freq buffers older exports carry, which are recomputed from rope_theta). The output directory gets the
  mode any new directory gets."""
  hf_dir = copy_of(saved["tied"], tmp_path)

  def add_head_and_buffers(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(CFG.head_dim // 2, np.float32)

  edit_tensors(os.path.join(hf_dir, WEIGHTS), add_head_and_buffers)
  assert convert_lib.main(["--from_hf", hf_dir, "--out", str(tmp_path / "out")]) == 0
  cfg, params = checkpoint_params.load_params(str(tmp_path / "out"))
  assert cfg.tie_embeddings and "lm_head" not in params
  np.testing.assert_array_equal(
    np.asarray(params["embed"]), load_file(os.path.join(hf_dir, WEIGHTS))["model.embed_tokens.weight"]
  )
  (tmp_path / "fresh").mkdir()
  assert os.stat(tmp_path / "out").st_mode == os.stat(tmp_path / "fresh").st_mode
  assert sorted(os.listdir(tmp_path)) == ["fresh", "hf", "out"]  # no scratch directory left


@pytest.mark.parametrize(
  "name,shape",
  [("model.layers.0.self_attn.q_norm.weight", (16,)), ("lm_head.bias", (256,)), ("model.embed_positions", (8, 64))],
  ids=["in_a_layer", "a_bias", "top_level"],
)
def test_an_unknown_tensor_name_is_refused(tmp_path, capsys, saved, name, shape):
  hf_dir = copy_of(saved["untied"], tmp_path)
  edit_tensors(os.path.join(hf_dir, WEIGHTS), lambda t: t.update({name: np.zeros(shape, np.float32)}))
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, f"found {name!r} in {os.path.join(hf_dir, WEIGHTS)}", "not a weight", "would drop it")


def test_a_sharded_index_that_disagrees_with_the_files_is_refused(tmp_path, capsys, saved):
  hf_dir = copy_of(saved["sharded"], tmp_path)
  index_path = os.path.join(hf_dir, safetensors_stream_lib.INDEX_FILE)
  with open(index_path) as f:
    weight_map = json.load(f)["weight_map"]
  files = [file for file in sorted(set(weight_map.values())) if list(weight_map.values()).count(file) > 1]
  name = next(n for n, file in weight_map.items() if file == files[-1])  # its file stays in the index
  edit_json(index_path, lambda index: {**index, "weight_map": {**weight_map, name: files[0]}})
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, f"puts {name!r} in {files[0]}, which does not hold it ({files[-1]} does)")
  edit_json(index_path, "{]")
  assert_names(convert_error(capsys, tmp_path, "--from_hf", hf_dir), f"{index_path} is not valid JSON")


def test_a_tensor_stored_in_two_files_is_refused(tmp_path, capsys, saved):
  hf_dir = copy_of(saved["untied"], tmp_path)
  save_file({"model.norm.weight": np.ones(CFG.dim, np.float32)}, os.path.join(hf_dir, "extra.safetensors"))
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, "'model.norm.weight' is stored twice", "extra.safetensors", WEIGHTS)


# ---------------------------------------------------------------------------------------------------------------------
# Malformed config.json


@pytest.mark.parametrize(
  "edit,fragments",
  [
    ('{"hidden_size": 64,', ["config.json is not valid JSON"]),
    ("[1, 2]", ["config.json holds a JSON list, not an object"]),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, ["config.json has no 'hidden_size' (required:"]),
    (lambda c: {**c, "num_hidden_layers": "2"}, ['config.json: num_hidden_layers must be an integer, got "2"']),
    (lambda c: {**c, "hidden_size": 64.0}, ["config.json: hidden_size must be an integer, got 64.0"]),
    (lambda c: {**c, "tie_word_embeddings": "false"}, ['tie_word_embeddings must be true or false, got "false"']),
    (lambda c: {**c, "rms_norm_eps": "1e-6"}, ['config.json: rms_norm_eps must be a number, got "1e-6"']),
    (lambda c: {**c, "rope_scaling": "linear"}, ['config.json: rope_scaling must be an object, got "linear"']),
    (
      lambda c: {**c, "rope_scaling": {"rope_type": "linear"}, "rope_parameters": None},
      ["config.json rope_scaling has no 'factor' (required for rope_type 'linear')"],
    ),
    (lambda c: {**c, "num_attention_heads": 0}, ["does not describe a valid model", "n_heads must be a positive"]),
  ],
  ids=[
    "not_json",
    "not_an_object",
    "missing_key",
    "string_for_int",
    "float_for_int",
    "string_for_bool",
    "string_for_number",
    "string_for_object",
    "rope_without_factor",
    "zero_heads",
  ],
)
def test_a_malformed_config_json_is_refused(tmp_path, capsys, saved, edit, fragments):
  hf_dir = copy_of(saved["untied"], tmp_path)
  edit_json(os.path.join(hf_dir, "config.json"), edit)
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, os.path.join(hf_dir, "config.json"), *fragments)


# ---------------------------------------------------------------------------------------------------------------------
# Damaged safetensors files


def header_of(path):
  with open(path, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    return length, f.read(length)


def replace_header(path, header):
  """The file with another header (bytes, or a value to encode), its data left as they are."""
  length, _ = header_of(path)
  with open(path, "rb") as f:
    f.seek(8 + length)
    data = f.read()
  encoded = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
  with open(path, "wb") as f:
    f.write(len(encoded).to_bytes(8, "little") + encoded + data)


def truncate(path, size):
  with open(path, "r+b") as f:
    f.truncate(size)


def edit_entry(name, **changes):
  def edit(path):
    _, header = header_of(path)
    header = json.loads(header)
    header[name] = {**header[name], **changes}
    replace_header(path, header)

  return edit


@pytest.mark.parametrize(
  "damage,fragments",
  [
    (lambda p: truncate(p, os.path.getsize(p) // 2), ["ends past the end of the file (truncated?)"]),
    (lambda p: truncate(p, 100), ["does not fit a 100-byte file"]),
    (lambda p: truncate(p, 5), ["does not fit a 5-byte file"]),
    (lambda p: replace_header(p, b"\x89garbage{{{"), ["is not a readable safetensors file", "utf-8"]),
    (lambda p: replace_header(p, b"{garbage"), ["is not a readable safetensors file", "Expecting property name"]),
    (lambda p: replace_header(p, b"[1, 2, 3]"), ["its header is not a JSON object"]),
    (edit_entry("model.norm.weight", shape=["64"]), ["tensor 'model.norm.weight' has dtype 'F32' and shape ['64']"]),
    (edit_entry("model.norm.weight", data_offsets=[8, 4]), ["'model.norm.weight' has data_offsets [8, 4]"]),
    (edit_entry("model.norm.weight", shape=[65]), ["'model.norm.weight' of shape (65,) and dtype F32 has 256 bytes"]),
  ],
  ids=[
    "truncated_data",
    "truncated_header",
    "shorter_than_the_length",
    "binary_header",
    "garbage_header",
    "header_not_an_object",
    "shape_of_strings",
    "offsets_backwards",
    "shape_against_bytes",
  ],
)
def test_a_damaged_safetensors_file_is_refused(tmp_path, capsys, saved, damage, fragments):
  hf_dir = copy_of(saved["untied"], tmp_path)
  damage(os.path.join(hf_dir, WEIGHTS))
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, os.path.join(hf_dir, WEIGHTS), *fragments)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_are_refused(tmp_path, capsys, saved, value):
  """NaN or infinity is the one sign of damaged data a safetensors file gives (no checksum); a checkpoint holding it
  would be refused by every later step anyway."""
  hf_dir = copy_of(saved["untied"], tmp_path)

  def spoil(tensors):
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"].copy()
    tensors["model.layers.1.self_attn.k_proj.weight"][5, 7] = value

  edit_tensors(os.path.join(hf_dir, WEIGHTS), spoil)
  line = convert_error(capsys, tmp_path, "--from_hf", hf_dir)
  assert_names(line, "'model.layers.1.self_attn.k_proj.weight' in", os.path.join(hf_dir, WEIGHTS), "NaN or infinity")


def test_a_file_truncated_after_its_header_was_read_is_refused(tmp_path, saved):
  """The header is checked against the file's size; a file that shrinks after that is caught by the short read."""
  path = shutil.copy(os.path.join(saved["untied"], WEIGHTS), str(tmp_path / WEIGHTS))
  reader = safetensors_stream.Reader([path])
  entry = reader.entries["lm_head.weight"]
  truncate(path, entry.offset + 100)
  with pytest.raises(safetensors_stream.SafetensorsError, match="ends inside tensor 'lm_head.weight'.*truncated"):
    reader.read_rows("lm_head.weight", 0, entry.shape[0])
  reader.close()


def test_a_truncated_safetensors_file_through_the_command_line(tmp_path, saved):
  """The real command line, once: exit status 2, one line, no output and no scratch directory."""
  hf_dir = copy_of(saved["untied"], tmp_path)
  truncate(os.path.join(hf_dir, WEIGHTS), os.path.getsize(os.path.join(hf_dir, WEIGHTS)) - 10)
  assert_one_line_error(run_cli("--from_hf", hf_dir, "--out", str(tmp_path / "out")), "truncated?", WEIGHTS)
  assert os.listdir(tmp_path) == ["hf"]


def test_a_failure_while_writing_leaves_no_output(tmp_path, capsys, saved, monkeypatch):
  """Writing goes to a scratch directory beside --out, renamed into place at the end: a failure found mid-way (a
  full disk, say) removes it."""
  hf_dir = copy_of(saved["untied"], tmp_path)

  def fail_half_way(directory, *args, **kwargs):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, paths.CONFIG_FILE), "w") as f:
      f.write("{}")
    raise digests.CheckpointError("no space left on device (simulated)")

  monkeypatch.setattr(checkpoint_params, "save_params_dir", fail_half_way)
  assert_names(convert_error(capsys, tmp_path, "--from_hf", hf_dir), "no space left on device (simulated)")


# ---------------------------------------------------------------------------------------------------------------------
# Meta's download


@pytest.mark.parametrize(
  "damage,fragments",
  [
    (lambda p: truncate(p, os.path.getsize(p) // 2), ["cannot read", "consolidated.01.pth", "damaged, truncated"]),
    (lambda p: open(p, "wb").write(b"not a torch file at all"), ["cannot read", "consolidated.01.pth"]),
    (lambda p: truncate(p, 0), ["cannot read", "consolidated.01.pth"]),
    (lambda p: torch.save([torch.ones(2)], p), ["consolidated.01.pth does not hold a state dict of tensors"]),
  ],
  ids=["truncated", "garbage", "empty", "a_list"],
)
def test_a_damaged_pth_shard_is_refused(tmp_path, capsys, saved_meta, damage, fragments):
  meta_dir = copy_of(saved_meta, tmp_path, "meta")
  damage(os.path.join(meta_dir, "consolidated.01.pth"))
  assert_names(convert_error(capsys, tmp_path, "--from_meta", meta_dir), *fragments)


@pytest.mark.parametrize(
  "edit,fragments",
  [
    ("{dim: 64,", ["params.json is not valid JSON"]),
    ('"dim"', ["params.json holds a JSON str, not an object"]),
    (lambda p: {**p, "dim": "64"}, ["does not describe a valid model", "dim must be a positive integer, got '64'"]),
    (lambda p: {**p, "n_layers": True}, ["does not describe a valid model", "n_layers must be a positive integer"]),
    (lambda p: {**p, "norm_eps": "1e-5"}, ["does not describe a valid model", "norm_eps must be a finite number"]),
    (lambda p: {k: v for k, v in p.items() if k != "norm_eps"}, ["params.json has no 'norm_eps'"]),
    (lambda p: {**p, "n_layers": 3}, ["consolidated.00.pth has no tensor 'layers.2."]),
    (lambda p: {**p, "n_layers": 1}, ["consolidated.00.pth holds 'layers.1.", "n_layers=1"]),
  ],
  ids=["not_json", "not_an_object", "string_dim", "bool_layers", "string_eps", "missing_key", "more_layers", "fewer"],
)
def test_a_bad_params_json_is_refused(tmp_path, capsys, saved_meta, edit, fragments):
  meta_dir = copy_of(saved_meta, tmp_path, "meta")
  edit_json(os.path.join(meta_dir, "params.json"), edit)
  assert_names(convert_error(capsys, tmp_path, "--from_meta", meta_dir), *fragments)


def test_a_missing_or_non_finite_meta_tensor_is_refused(tmp_path, capsys, saved_meta):
  meta_dir = copy_of(saved_meta, tmp_path, "meta")
  path = os.path.join(meta_dir, "consolidated.01.pth")
  shard = torch.load(path, weights_only=True)
  wq = shard.pop("layers.1.attention.wq.weight")
  torch.save(shard, path)
  line = convert_error(capsys, tmp_path, "--from_meta", meta_dir)
  assert_names(line, "consolidated.01.pth has no tensor 'layers.1.attention.wq.weight'")
  wq[3, 2] = float("nan")
  torch.save({**shard, "layers.1.attention.wq.weight": wq}, path)
  line = convert_error(capsys, tmp_path, "--from_meta", meta_dir)
  assert_names(line, f"layers.1.attention.wq.weight in {path} holds NaN or infinity")
