"""HF transformers Llama directories in and out: which tensor is which params leaf, the checks that every stored tensor
is one the config accounts for and every implied one is stored, and streaming conversions.

    from_hf(HF_DIR, OUT)   config.json + (sharded) *.safetensors → a llama_jax checkpoint directory
    to_hf(CKPT_DIR, OUT)   a llama_jax checkpoint directory (latest or given step; a LoRA workdir merged) → an HF one

Conversion streams tensor by tensor, so peak host memory stays near the model's bytes (bench/convert_memory.py
measures it): from_hf reads each safetensors tensor from its file in pieces straight into preallocated stacked
[L, ...] arrays, and to_hf restores one parameter at a time and writes each HF tensor in pieces. Everything is checked
before the output directory is created, and the output is written beside it and renamed into place (output.py).
Conversion is honest: every stored tensor must be one the config accounts for (no extra layer, no unknown name, no
lm_head under a tied config unless it equals the embedding) and every tensor the config implies must be stored; a
malformed config.json, index or safetensors file, and NaN or infinity in the weights, are one line naming the file.

RoPE layout: llama_jax rotates the two halves of each head (HF's ``rotate_half``), so HF weights map by transposes and
reshapes only, and a round trip is bit-exact.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.data.tokenization import Tokenizer
from llama_jax.interop import safetensors_stream
from llama_jax.interop.hf_config import (
  DTYPES_FROM_HF,
  check_hf_expressible,
  hf_config_from_model_config,
  model_config_from_hf,
)
from llama_jax.interop.output import (
  ConvertError,
  check_new_output,
  check_tokenizer,
  new_output_dir,
  tokenizer_extras_in,
  tokenizer_in,
)
from llama_jax.interop.safetensors_stream import INDEX_FILE, row_blocks
from llama_jax.model import sharding
from llama_jax.model.llama import Llama

# ---------------------------------------------------------------------------------------------------------------------
# Where each HF tensor lives in the params tree. Every HF tensor is a (layer slice of a) params leaf in [out, in]
# order, seen either as it is (embedding, norms) or transposed (all projections), so one table serves reading, writing
# and Meta's shards alike.

# HF name suffix of a layer tensor → (params path, stored transposed).
_HF_LAYER_TENSORS = {
  "input_layernorm.weight": (("layers", "attention_norm", "scale"), False),
  "self_attn.q_proj.weight": (("layers", "attention", "wq"), True),
  "self_attn.k_proj.weight": (("layers", "attention", "wk"), True),
  "self_attn.v_proj.weight": (("layers", "attention", "wv"), True),
  "self_attn.o_proj.weight": (("layers", "attention", "wo"), True),
  "post_attention_layernorm.weight": (("layers", "mlp_norm", "scale"), False),
  "mlp.gate_proj.weight": (("layers", "mlp", "w_gate"), True),
  "mlp.up_proj.weight": (("layers", "mlp", "w_up"), True),
  "mlp.down_proj.weight": (("layers", "mlp", "w_down"), True),
}


# A Mixtral layer's mixture of experts, as published checkpoints store it (transformers ≥ 5 fuses the experts in
# memory and writes this layout back on save): HF name suffix → (params path, stored transposed); the expert
# tensors' names hold the expert index in place of "{e}".
_HF_MOE_ROUTER = "block_sparse_moe.gate.weight"
_HF_MOE_TENSORS = {
  _HF_MOE_ROUTER: (("layers", "mlp", "router"), True),
  "block_sparse_moe.experts.{e}.w1.weight": (("layers", "mlp", "w_gate"), True),
  "block_sparse_moe.experts.{e}.w3.weight": (("layers", "mlp", "w_up"), True),
  "block_sparse_moe.experts.{e}.w2.weight": (("layers", "mlp", "w_down"), True),
}
_HF_MLP_SUFFIXES = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

# Each projection's HF module name (what peft's target_modules and tensor names use): "wq" → "self_attn.q_proj".
HF_MODULES = {
  path[-1]: name.removesuffix(".weight") for name, (path, transposed) in _HF_LAYER_TENSORS.items() if transposed
}


class HFTensor(NamedTuple):
  name: str  # as transformers names it
  path: tuple[str, ...]  # of the params leaf
  layer: int | None  # index into the stacked layer axis, None for leaves outside the layers
  transposed: bool  # the leaf stores the HF tensor transposed ([in, out])
  shape: tuple[int, ...]  # HF shape, [out, in]
  expert: int | None = None  # index into a mixture's stacked expert axis (after the layer axis)


def hf_tensor_plan(cfg: ModelConfig) -> list[HFTensor]:
  """Every HF tensor of the model, grouped by params leaf (so a leaf is needed once, then never again)."""
  check_hf_expressible(cfg)
  d, f, h = cfg.dim, cfg.hidden_dim, cfg.head_dim
  layer_shapes = {
    "input_layernorm.weight": (d,),
    "self_attn.q_proj.weight": (cfg.n_heads * h, d),
    "self_attn.k_proj.weight": (cfg.n_kv_heads * h, d),
    "self_attn.v_proj.weight": (cfg.n_kv_heads * h, d),
    "self_attn.o_proj.weight": (d, cfg.n_heads * h),
    "post_attention_layernorm.weight": (d,),
    "mlp.gate_proj.weight": (f, d),
    "mlp.up_proj.weight": (f, d),
    "mlp.down_proj.weight": (d, f),
  }
  plan = [HFTensor("model.embed_tokens.weight", ("embed",), None, False, (cfg.vocab_size, d))]
  for suffix, (path, transposed) in _HF_LAYER_TENSORS.items():
    if cfg.moe.enabled and suffix in _HF_MLP_SUFFIXES:
      continue
    plan += [
      HFTensor(f"model.layers.{i}.{suffix}", path, i, transposed, layer_shapes[suffix]) for i in range(cfg.n_layers)
    ]
  if cfg.moe.enabled:
    moe_shapes = dict(zip(_HF_MOE_TENSORS, [(cfg.moe.num_experts, d), (f, d), (f, d), (d, f)]))
    for suffix, (path, transposed) in _HF_MOE_TENSORS.items():
      experts = [None] if suffix == _HF_MOE_ROUTER else range(cfg.moe.num_experts)
      plan += [
        HFTensor(f"model.layers.{i}.{suffix.format(e=e)}", path, i, transposed, moe_shapes[suffix], e)
        for i in range(cfg.n_layers)
        for e in experts
      ]
  plan.append(HFTensor("model.norm.weight", ("final_norm", "scale"), None, False, (d,)))
  if not cfg.tie_embeddings:
    plan.append(HFTensor("lm_head.weight", ("lm_head",), None, True, (cfg.vocab_size, d)))
  return plan


def hf_view(leaf: np.ndarray, tensor: HFTensor) -> np.ndarray:
  """The HF tensor as a view of its params leaf: writes to it fill the leaf (a C-contiguous leaf, as every leaf made
  or restored here is, reshapes without a copy)."""
  part = leaf if tensor.layer is None else leaf[tensor.layer]
  part = part if tensor.expert is None else part[tensor.expert]
  view = part.reshape(tensor.shape[::-1] if tensor.transposed else tensor.shape)
  return view.T if tensor.transposed else view


def leaf_at(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def empty_params(cfg: ModelConfig) -> dict[str, Any]:
  """The params tree as uninitialised numpy arrays, shaped like the model's own abstract tree."""
  _, target = sharding.abstract_params(Llama, cfg)
  return jax.tree.map(lambda a: np.empty(a.shape, a.dtype), target)


# Stored tensors that are not weights: rotary frequencies, which some older exports carry (per layer) and which are
# recomputed from rope_theta here, as transformers recomputes them.
_HF_INV_FREQ = re.compile(r"model\.(?:layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TIED_HEAD = "lm_head.weight"


def _check_hf_tensors(
  shapes: Mapping[str, tuple[int, ...]],
  cfg: ModelConfig,
  file_of: Callable[[str], str] = lambda name: "the tensors given",
  sources: str = "the tensors given",
  config: str = "config.json",
) -> None:
  """Every tensor `config` implies is stored (in `sources`) with its shape, and every stored tensor is one it implies:
  a layer past num_hidden_layers or a name llama_jax does not know would otherwise be dropped without a word. Under a
  tied config a stored lm_head is let through here, for ``_check_tied_head`` to compare with the embedding."""
  expected = {t.name: t.shape for t in hf_tensor_plan(cfg)}
  if cfg.tie_embeddings:
    expected[_TIED_HEAD] = expected["model.embed_tokens.weight"]
  for name in shapes:
    if name in expected:
      continue
    layer = _HF_LAYER_NAME.fullmatch(name)
    if layer and int(layer.group(1)) >= cfg.n_layers:
      raise ConvertError(
        f"found {name!r} in {file_of(name)}, but {config} has num_hidden_layers={cfg.n_layers}: the stored model has "
        "more layers than its config, and converting would drop them; correct num_hidden_layers"
      )
    if not _HF_INV_FREQ.fullmatch(name):
      raise ConvertError(
        f"found {name!r} in {file_of(name)}, which is not a weight of the model {config} describes; "
        "converting would drop it"
      )
  missing = [name for name in expected if name not in shapes and not (cfg.tie_embeddings and name == _TIED_HEAD)]
  if missing:
    raise ConvertError(
      f"{missing[0]!r} is missing from {sources}: {config} implies it (num_hidden_layers={cfg.n_layers}, "
      f"tie_word_embeddings={str(cfg.tie_embeddings).lower()}); {len(missing)} of {len(hf_tensor_plan(cfg))} tensors "
      "are missing"
    )
  for name, shape in expected.items():
    if name in shapes and tuple(shapes[name]) != shape:
      raise ConvertError(
        f"tensor {name!r} in {file_of(name)} has shape {tuple(shapes[name])}, but {config} implies {shape}"
      )


def _check_tied_head(
  cfg: ModelConfig, read_rows: Callable[[str, int, int], np.ndarray], file: str, config: str = "config.json"
) -> None:
  """A tied config has no lm_head of its own. Some exporters store the embedding again as lm_head, which is fine; a
  stored head that differs is a distinct one (a user's was up to 0.11 away) the conversion would drop: refused."""
  worst, differs = 0.0, False
  for start, stop in row_blocks((cfg.vocab_size, cfg.dim)):
    head = read_rows(_TIED_HEAD, start, stop).astype(np.float32)
    embedding = read_rows("model.embed_tokens.weight", start, stop).astype(np.float32)
    for name, rows in ((_TIED_HEAD, head), ("model.embed_tokens.weight", embedding)):
      if not np.isfinite(rows).all():  # damage, not a distinct head: say so, as _params_from_rows would
        raise ConvertError(
          f"tensor {name!r} in {file} holds NaN or infinity (rows {start}-{stop - 1}): the file is damaged, or "
          "the model was saved after it diverged"
        )
    if not np.array_equal(head, embedding):
      differs = True
      worst = max(worst, float(np.nan_to_num(np.abs(head - embedding), nan=np.inf).max()))
  if differs:
    raise ConvertError(
      f"found an lm_head.weight in {file} that differs from model.embed_tokens.weight (by up to {worst:.3g}), but "
      f"{config} sets tie_word_embeddings=true, so converting would drop it; set it to false to keep the head"
    )


def _params_from_rows(
  cfg: ModelConfig,
  read_rows: Callable[[str, int, int], np.ndarray],
  file_of: Callable[[str], str] = lambda name: "the tensors given",
) -> dict[str, Any]:
  """Fills a new params tree HF tensor by HF tensor, block of rows by block; values are cast to cfg.param_dtype.
  A block holding NaN or infinity is refused: the one sign of damaged data a safetensors file gives (it has no
  checksum), and a checkpoint every later step (training, export) would refuse anyway."""
  params = empty_params(cfg)
  for tensor in hf_tensor_plan(cfg):
    hf = hf_view(leaf_at(params, tensor.path), tensor)
    for start, stop in row_blocks(tensor.shape):
      rows = read_rows(tensor.name, start, stop)
      if not np.isfinite(rows).all():
        raise ConvertError(
          f"tensor {tensor.name!r} in {file_of(tensor.name)} holds NaN or infinity (rows {start}-{stop - 1}): the "
          "file is damaged, or the model was saved after it diverged"
        )
      hf[start:stop] = rows
  return params


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """HF tensors (name → [out, in] arrays) → the llama_jax params tree (numpy, layers stacked on axis 0), checked as
  a directory's are: every tensor accounted for, a tied head equal to the embedding."""

  def read_rows(name: str, start: int, stop: int) -> np.ndarray:
    return np.asarray(tensors[name][start:stop])

  _check_hf_tensors({name: np.shape(a) for name, a in tensors.items()}, cfg)
  if cfg.tie_embeddings and _TIED_HEAD in tensors:
    _check_tied_head(cfg, read_rows, "the tensors given")
  return _params_from_rows(cfg, read_rows)


def hf_from_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of ``params_from_hf``: contiguous HF-layout arrays named as transformers names them."""
  return {t.name: np.ascontiguousarray(hf_view(np.asarray(leaf_at(params, t.path)), t)) for t in hf_tensor_plan(cfg)}


def write_hf_tensors(
  out_dir: str, cfg: ModelConfig, leaf_of: Callable[[tuple[str, ...]], np.ndarray], max_shard_bytes: int
) -> None:
  """model.safetensors, or files of at most `max_shard_bytes` with an index, asking `leaf_of` for each params leaf
  in the plan's order (each leaf once)."""
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

  def hf_of(t: HFTensor) -> np.ndarray:
    return hf_view(leaf_of(t.path), t)

  safetensors_stream.write_sharded(out_dir, hf_tensor_plan(cfg), dtype, hf_of, max_shard_bytes)


# ---------------------------------------------------------------------------------------------------------------------
# HF directories


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConvertError(f"{path} is not valid JSON: {e}") from e
  except OSError as e:
    raise ConvertError(f"cannot read {path}: {e.strerror or e}") from e


def _safetensors_files(hf_dir: str) -> tuple[list[str], dict[str, str] | None]:
  """The safetensors files of a directory: those its index names (with the index's name → file map), or all."""
  index_path = os.path.join(hf_dir, INDEX_FILE)
  if not os.path.isfile(index_path):
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
      raise ConvertError(f"{hf_dir!r} has no *.safetensors files (PyTorch .bin files are not read: no torch here)")
    return files, None
  index = _read_json(index_path)
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not (isinstance(weight_map, dict) and weight_map and all(isinstance(file, str) for file in weight_map.values())):
    raise ConvertError(f"{index_path} has no weight_map of tensor names to file names")
  files = [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
  for path in files:
    if not os.path.isfile(path):
      raise ConvertError(f"{INDEX_FILE} names {os.path.basename(path)!r}, which is missing from {hf_dir!r}")
  return files, weight_map


def _check_index(entries: Mapping[str, safetensors_stream.Entry], weight_map: Mapping[str, str]) -> None:
  """The index and the files' headers agree: a tensor listed in the wrong file, or in none, means a shard was
  replaced or the index edited, and either could be the one to trust."""
  for name, file in weight_map.items():
    held_by = os.path.basename(entries[name].path) if name in entries else None
    if held_by != file:
      raise ConvertError(
        f"{INDEX_FILE} puts {name!r} in {file}, which does not hold it"
        + (f" ({held_by} does)" if held_by else " (no file does)")
      )
  for name, entry in entries.items():
    if name not in weight_map:
      raise ConvertError(f"found {name!r} in {os.path.basename(entry.path)}, which {INDEX_FILE} does not list")


def open_hf_dir(hf_dir: str) -> tuple[ModelConfig, safetensors_stream.Reader]:
  """config.json plus single or sharded (index.json) safetensors of a transformers Llama directory, checked against
  each other from the file headers (every tensor the config implies is stored with its shape, every stored tensor is
  one it implies), and a stored lm_head under a tied config compared with the embedding."""
  if not os.path.isdir(hf_dir):
    raise ConvertError(f"HF directory {hf_dir!r} does not exist")
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(config_path):
    raise ConvertError(f"{hf_dir!r} has no config.json")
  hf_config = _read_json(config_path)
  if not isinstance(hf_config, dict):
    raise ConvertError(f"{config_path} holds a JSON {type(hf_config).__name__}, not an object")
  cfg = model_config_from_hf(hf_config, config_path)
  files, weight_map = _safetensors_files(hf_dir)
  reader = safetensors_stream.Reader(files)
  try:
    if weight_map is not None:
      _check_index(reader.entries, weight_map)

    def file_of(name: str) -> str:
      return reader.entries[name].path

    sources = files[0] if len(files) == 1 else f"the {len(files)} safetensors files of {hf_dir}"
    _check_hf_tensors({name: e.shape for name, e in reader.entries.items()}, cfg, file_of, sources, config_path)
    if cfg.tie_embeddings and _TIED_HEAD in reader.entries:
      _check_tied_head(cfg, reader.read_rows, file_of(_TIED_HEAD), config_path)
    dtypes = sorted({reader.dtype(t.name).name for t in hf_tensor_plan(cfg)})
  except BaseException:
    reader.close()
    raise
  if len(dtypes) == 1 and dtypes[0] in DTYPES_FROM_HF:
    cfg = cfg.replace(param_dtype=dtypes[0])  # keep the stored dtype, so a round trip is bit-exact
  return cfg, reader


def write_hf_dir(
  out_dir: str,
  cfg: ModelConfig,
  params: Mapping[str, Any],
  tokenizer_path: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
) -> None:
  """config.json + model.safetensors (or shards of at most `max_shard_bytes` with an index) that transformers loads."""
  check_new_output(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  write_hf_tensors(out_dir, cfg, lambda path: np.asarray(leaf_at(params, path)), max_shard_bytes)
  write_hf_metadata(out_dir, cfg, tokenizer_path)


def write_hf_metadata(
  out_dir: str, cfg: ModelConfig, tokenizer_path: str | None, extra_files: Mapping[str, bytes] | None = None
) -> None:
  """config.json, the tokenizer, and `extra_files` (tokenizer.json and the tokenizer's side files) as given; a
  sentencepiece tokenizer without a tokenizer_config.json gets one."""
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_from_model_config(cfg), f, indent=2)
  for name, content in (extra_files or {}).items():
    with open(os.path.join(out_dir, name), "wb") as f:
      f.write(content)
  if tokenizer_path:
    shutil.copyfile(tokenizer_path, os.path.join(out_dir, paths.TOKENIZER_FILE))
    if paths.TOKENIZER_CONFIG_FILE not in (extra_files or {}):
      _write_tokenizer_config(out_dir, tokenizer_path)


def _write_tokenizer_config(out_dir: str, tokenizer_path: str) -> None:
  """tokenizer_config.json next to the tokenizer: without it transformers' AutoTokenizer loads the sentencepiece
  model but never adds bos (measured with transformers 5.24), so a client tokenizing for the export (lm-eval against
  ``serve``) would send other ids than llama_jax's own encode(bos=True). No tokenizer_class: LlamaTokenizer rebuilds
  the pre-tokenizer and splits runs of spaces differently (309 of 2,635 Shakespeare lines)."""
  tokenizer = Tokenizer(tokenizer_path)
  names = (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("unk_token", tokenizer.unk_id))
  config = {name: tokenizer.id_to_piece(token_id) for name, token_id in names if token_id >= 0}
  config.update(add_bos_token=tokenizer.bos_id >= 0, add_eos_token=False)
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)


# ---------------------------------------------------------------------------------------------------------------------
# The conversions


def from_hf(hf_dir: str, out_dir: str) -> ModelConfig:
  """Converts a transformers Llama or Mixtral directory into a new llama_jax checkpoint directory.

  The output holds the params at step 0, the model config and the tokenizer with its side files, if present.
  Conversion streams tensor by tensor from the safetensors files straight into the params, and is honest: every
  stored tensor must be one config.json accounts for, and every tensor it implies must be stored. The params keep
  the stored dtype where all tensors share one of the dtypes llama_jax reads, so a round trip is bit-exact.
  Everything is read and checked before anything is written, and the output is written beside `out_dir` and renamed
  into place: a failure leaves no output directory.

  Args:
    hf_dir: the HF directory: config.json and one or sharded safetensors files, with an index when sharded.
    out_dir: the new checkpoint directory; it must not exist or be empty.

  Returns:
    The model config of config.json, its param_dtype the stored one when all tensors share it.

  Raises:
    ConvertError: `out_dir` is not empty; config.json, the index or a tensor is missing, malformed, or not one
      llama_jax can express; a stored lm_head under a tied config differs from the embedding; a weight holds NaN or
      infinity; or the tokenizer has more tokens than the model's embedding has rows.
    SafetensorsError: a safetensors file cannot be read, stores a tensor twice, or holds a dtype llama_jax does
      not read.
    TokenizerError: the directory's tokenizer is broken.
  """
  check_new_output(out_dir)
  cfg, reader = open_hf_dir(hf_dir)
  with contextlib.closing(reader):
    check_tokenizer(hf_dir, cfg.vocab_size)
    params = _params_from_rows(cfg, reader.read_rows, lambda name: reader.entries[name].path)
  with new_output_dir(out_dir) as scratch:
    checkpoint_params.save_params_dir(
      scratch, cfg, params, tokenizer_path=tokenizer_in(hf_dir), extra_files=tokenizer_extras_in(hf_dir)
    )
  return cfg


def to_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, step: int | None = None) -> ModelConfig:
  """Converts a llama_jax checkpoint directory into a new transformers directory, a LoRA workdir merged.

  The output holds config.json for LlamaForCausalLM, or MixtralForCausalLM for a mixture of experts, the weights as
  model.safetensors or as shards with an index, and the tokenizer and its side files, if present. Conversion
  restores one parameter at a time and writes each HF tensor in pieces, so the whole model is never held twice. The
  output is written beside `out_dir` and renamed into place: a failure leaves no output directory.

  Args:
    checkpoint_dir: the llama_jax checkpoint directory or LoRA workdir.
    out_dir: the new HF directory; it must not exist or be empty.
    max_shard_bytes: the most bytes of one safetensors file; a larger model is split into shards with an index.
    step: the step to convert, or None for the latest complete one.

  Returns:
    The checkpoint's model config.

  Raises:
    ConvertError: `out_dir` is not empty, or the model has no HF form: a norm other than RMSNorm before each
      sub-layer, or a mixture of experts HF Mixtral cannot express.
    CheckpointError: the checkpoint directory or the step is missing or damaged.
    LoraError: the base a LoRA workdir adapts has changed since the run started from it.
  """
  check_new_output(out_dir)
  check_hf_expressible(checkpoint_params.read_model_config(checkpoint_dir), repr(checkpoint_dir))
  reader = checkpoint_params.open_reader(checkpoint_dir, step)
  with contextlib.closing(reader), new_output_dir(out_dir) as scratch:
    write_hf_tensors(scratch, reader.cfg, reader.read_leaf, max_shard_bytes)
    write_hf_metadata(scratch, reader.cfg, tokenizer_in(checkpoint_dir), tokenizer_extras_in(checkpoint_dir))
  return reader.cfg
