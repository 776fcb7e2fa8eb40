"""Weights in and out: HF transformers Llama directories and Meta's original LLaMA 2 downloads → llama_jax checkpoint
directories, and llama_jax checkpoints → HF directories.

    python -m llama_jax.convert --from_hf HF_DIR --out CKPT_DIR      # config.json + (sharded) *.safetensors
    python -m llama_jax.convert --from_meta META_DIR --out CKPT_DIR  # params.json + consolidated.NN.pth (needs torch)
    python -m llama_jax.convert --to_hf CKPT_DIR --out HF_DIR        # → config.json + *.safetensors for transformers
    python -m llama_jax.convert --merge_lora LORA_DIR --out CKPT_DIR  # a LoRA workdir's base + adapters, merged
    python -m llama_jax.convert --to_hf LORA_DIR --peft --out DIR    # its adapter for HF peft

Conversion streams tensor by tensor, so peak host memory stays near the model's bytes (bench/convert_memory.py
measures it): --from_hf reads each safetensors tensor from its file in pieces straight into preallocated stacked
[L, ...] arrays, --from_meta copies from memory-mapped .pth shards the same way, and --to_hf restores one parameter at
a time and writes each HF tensor in pieces. Everything is checked before the output directory is created, and the
output is written beside it and renamed into place, so a failed conversion leaves nothing behind. Conversion is honest:
every stored tensor must be one the config accounts for (no extra layer, no unknown name, no lm_head under a tied
config unless it equals the embedding) and every tensor the config implies must be stored; a malformed config.json,
params.json, index, safetensors file or .pth shard, and NaN or infinity in the weights, are one line naming the file.

RoPE layout: llama_jax rotates the two halves of each head (HF's ``rotate_half``), so HF weights map by transposes and
reshapes only, and a round trip is bit-exact. Meta's original ``consolidated.*.pth`` weights rotate interleaved pairs
(x0,x1), (x2,x3)...; --from_meta permutes the rows of wq and wk with ``permute_meta_qk``.

This module holds the mapping (HF config ↔ ModelConfig, HF tensor names ↔ params leaves) and the three conversions;
the file formats live beside it: safetensors_stream.py reads and writes safetensors files a block of rows at a time,
meta_checkpoint.py reads Meta's params.json and merges its model-parallel shards.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from llama_jax import checkpoint, safetensors_stream
from llama_jax import lora as lora_lib
from llama_jax.cli import ArgumentParser
from llama_jax.config import ConfigError, ModelConfig
from llama_jax.errors import LlamaJaxError, run_or_exit
from llama_jax.meta_checkpoint import MetaShards, permute_meta_qk  # noqa: F401 (permute_meta_qk: known from here too)
from llama_jax.safetensors_stream import CHUNK_BYTES, INDEX_FILE, row_blocks
from llama_jax.tokenizer import TOKENIZER_FILE, Tokenizer

_DTYPES_FROM_HF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ConvertError(LlamaJaxError, ValueError):
  """The input cannot be converted; the message names the file, tensor or value."""


def check_hf_expressible(cfg: ModelConfig, where: str = "the model") -> None:
  """Refuses a norm variant (config.NORMS, NORM_POSITIONS) for HF conversion: transformers' LlamaForCausalLM is
  RMSNorm before each sub-layer plus a final norm, and has no place for a layernorm, a post-norm or no norm."""
  if (cfg.norm, cfg.norm_position) != ("rmsnorm", "pre"):
    raise ConvertError(
      f"{where} has norm={cfg.norm!r}, norm_position={cfg.norm_position!r}; HF Llama has only norm='rmsnorm', "
      f"norm_position='pre', so it cannot be converted"
    )


# The keys of a transformers Llama config.json that have no default (shapes follow from them).
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_REQUIRED = object()
_JSON_KINDS = {  # what a config.json value must be → test
  "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
  "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
  "true or false": lambda v: isinstance(v, bool),
  "a string": lambda v: isinstance(v, str),
  "an object": lambda v: isinstance(v, dict),
}


def _hf_value(hf: Mapping[str, Any], key: str, kind: str, where: str, default: Any = _REQUIRED, why: str = "") -> Any:
  """hf[key] checked to be `kind` (`default` when absent, or null where a default exists): a string where a number
  belongs would otherwise fail later with a traceback, and the string "false" would tie the embeddings."""
  if key not in hf or (hf[key] is None and default is not _REQUIRED):
    if default is _REQUIRED:
      raise ConvertError(f"{where} has no {key!r}" + (f" ({why})" if why else ""))
    return default
  value = hf[key]
  if not _JSON_KINDS[kind](value):
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ConvertError(f"{where}: {key} must be {kind}, got {shown}")
  return value


def model_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
  """ModelConfig from a transformers Llama ``config.json`` (`where` names it in messages); features llama_jax lacks
  are refused by name, and so is a missing or mistyped key."""
  for key in ("attention_bias", "mlp_bias"):
    if _hf_value(hf, key, "true or false", where, False):
      raise ConvertError(f"{where} sets {key}=true; LLaMA 2 has no biases and llama_jax does not support them")
  hidden_act = _hf_value(hf, "hidden_act", "a string", where, "silu")
  if hidden_act != "silu":
    raise ConvertError(f"{where} hidden_act={hidden_act!r}; only 'silu' (SwiGLU) is supported")
  required = f"required: {', '.join(_HF_REQUIRED)}"
  vocab_size, dim, n_layers, n_heads, ffn_hidden_dim = (
    _hf_value(hf, key, "an integer", where, why=required) for key in _HF_REQUIRED
  )
  head_dim = _hf_value(hf, "head_dim", "an integer", where, None)
  dtype = _hf_value(hf, "dtype", "a string", where, None) or _hf_value(hf, "torch_dtype", "a string", where, None)
  dtype = dtype or "float32"
  if dtype not in _DTYPES_FROM_HF:
    raise ConvertError(f"{where} dtype {dtype!r} is not one of {sorted(_DTYPES_FROM_HF)}")
  rope_where = f"{where} rope_scaling"
  rope = _hf_value(hf, "rope_scaling", "an object", where, {})
  # transformers ≥ 5 keeps theta and scaling together in rope_parameters.
  rope_parameters = _hf_value(hf, "rope_parameters", "an object", where, {})
  theta = _hf_value(rope_parameters, "rope_theta", "a number", f"{where} rope_parameters", None)
  theta = _hf_value(hf, "rope_theta", "a number", where, 10000.0) if theta is None else theta
  if _hf_value(rope_parameters, "rope_type", "a string", f"{where} rope_parameters", "default") != "default":
    rope, rope_where = rope_parameters, f"{where} rope_parameters"
  kind = "none"
  if rope:
    kind = _hf_value(rope, "rope_type", "a string", rope_where, None) or _hf_value(
      rope, "type", "a string", rope_where, "none"
    )
  kind = "none" if kind == "default" else kind
  fields = dict(
    vocab_size=vocab_size,
    dim=dim,
    n_layers=n_layers,
    n_heads=n_heads,
    n_kv_heads=_hf_value(hf, "num_key_value_heads", "an integer", where, None),  # None: n_heads
    ffn_hidden_dim=ffn_hidden_dim,
    norm_eps=float(_hf_value(hf, "rms_norm_eps", "a number", where, 1e-6)),
    rope_theta=float(theta),
    max_seq_len=_hf_value(hf, "max_position_embeddings", "an integer", where, 4096),
    tie_embeddings=_hf_value(hf, "tie_word_embeddings", "true or false", where, False),
    dtype=_DTYPES_FROM_HF[dtype],
    param_dtype=_DTYPES_FROM_HF[dtype],
    rope_scaling=kind,
  )

  def rope_number(key: str) -> Any:
    return _hf_value(rope, key, "a number", rope_where, why=f"required for rope_type {kind!r}")

  if kind in ("linear", "llama3"):
    fields["rope_scaling_factor"] = float(rope_number("factor"))
  if kind == "llama3":
    fields.update(
      rope_low_freq_factor=float(rope_number("low_freq_factor")),
      rope_high_freq_factor=float(rope_number("high_freq_factor")),
      rope_original_max_len=_hf_value(
        rope, "original_max_position_embeddings", "an integer", rope_where, why="required for rope_type 'llama3'"
      ),
    )
  try:
    cfg = ModelConfig(**fields)
  except ConfigError as e:
    raise ConvertError(f"{where} does not describe a valid model: {e}") from e
  if head_dim not in (None, cfg.head_dim):
    raise ConvertError(
      f"{where} head_dim={head_dim} differs from hidden_size/num_attention_heads={cfg.head_dim}; not supported"
    )
  return cfg


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
  """A transformers ``config.json`` for LlamaForCausalLM with these hyper-parameters."""
  rope_scaling = None
  if cfg.rope_scaling == "linear":
    rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
  elif cfg.rope_scaling == "llama3":
    rope_scaling = {
      "rope_type": "llama3",
      "factor": cfg.rope_scaling_factor,
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
      "original_max_position_embeddings": cfg.rope_original_max_len,
    }
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "intermediate_size": cfg.hidden_dim,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": rope_scaling,
    "tie_word_embeddings": cfg.tie_embeddings,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": cfg.param_dtype,
  }


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


class HFTensor(NamedTuple):
  name: str  # as transformers names it
  path: tuple[str, ...]  # of the params leaf
  layer: int | None  # index into the stacked layer axis, None for leaves outside the layers
  transposed: bool  # the leaf stores the HF tensor transposed ([in, out])
  shape: tuple[int, ...]  # HF shape, [out, in]


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
    plan += [
      HFTensor(f"model.layers.{i}.{suffix}", path, i, transposed, layer_shapes[suffix]) for i in range(cfg.n_layers)
    ]
  plan.append(HFTensor("model.norm.weight", ("final_norm", "scale"), None, False, (d,)))
  if not cfg.tie_embeddings:
    plan.append(HFTensor("lm_head.weight", ("lm_head",), None, True, (cfg.vocab_size, d)))
  return plan


def _hf_view(leaf: np.ndarray, tensor: HFTensor) -> np.ndarray:
  """The HF tensor as a view of its params leaf: writes to it fill the leaf (a C-contiguous leaf, as every leaf made
  or restored here is, reshapes without a copy)."""
  part = leaf if tensor.layer is None else leaf[tensor.layer]
  view = part.reshape(tensor.shape[::-1] if tensor.transposed else tensor.shape)
  return view.T if tensor.transposed else view


def _leaf(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _empty_params(cfg: ModelConfig) -> dict[str, Any]:
  """The params tree as uninitialised numpy arrays, shaped like the model's own abstract tree."""
  from llama_jax import sharding
  from llama_jax.model import Llama

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
        f"found {name!r} in {file_of(name)}, which is not a weight of the LlamaForCausalLM {config} describes; "
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
  params = _empty_params(cfg)
  for tensor in hf_tensor_plan(cfg):
    hf = _hf_view(_leaf(params, tensor.path), tensor)
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
  return {t.name: np.ascontiguousarray(_hf_view(np.asarray(_leaf(params, t.path)), t)) for t in hf_tensor_plan(cfg)}


def _write_hf_tensors(
  out_dir: str, cfg: ModelConfig, leaf_of: Callable[[tuple[str, ...]], np.ndarray], max_shard_bytes: int
) -> None:
  """model.safetensors, or files of at most `max_shard_bytes` with an index, asking `leaf_of` for each params leaf
  in the plan's order (each leaf once)."""
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

  def hf_of(t: HFTensor) -> np.ndarray:
    return _hf_view(leaf_of(t.path), t)

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
  model_type = _hf_value(hf_config, "model_type", "a string", config_path, "llama")
  if model_type != "llama":
    raise ConvertError(f"{config_path} has model_type={model_type!r}; only 'llama' is supported")
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
  if len(dtypes) == 1 and dtypes[0] in _DTYPES_FROM_HF:
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
  _check_new_output(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  _write_hf_tensors(out_dir, cfg, lambda path: np.asarray(_leaf(params, path)), max_shard_bytes)
  _write_hf_metadata(out_dir, cfg, tokenizer_path)


def _write_hf_metadata(out_dir: str, cfg: ModelConfig, tokenizer_path: str | None) -> None:
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_from_model_config(cfg), f, indent=2)
  if tokenizer_path:
    shutil.copyfile(tokenizer_path, os.path.join(out_dir, TOKENIZER_FILE))
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
# llama_jax checkpoints, one params leaf at a time


class _CheckpointLeaves:
  """The params of the latest complete (or given) step of a checkpoint directory, checked against its digests and
  restored one leaf at a time as numpy (and refused if non-finite, as ``checkpoint.load_params`` does), so that
  exporting never holds the whole model twice."""

  def __init__(self, directory: str, step: int | None = None):
    from llama_jax import sharding
    from llama_jax.model import Llama

    self.directory = directory
    self.cfg = checkpoint.read_model_config(directory)
    steps_dir = checkpoint._steps_path(directory)
    self._manager = None
    if os.path.isdir(steps_dir) or checkpoint.is_remote(directory):
      options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
      self._manager = ocp.CheckpointManager(
        steps_dir, options=options, item_handlers={"params": ocp.PyTreeCheckpointHandler()}
      )
    try:
      self.step = checkpoint.checked_step(
        directory, self._manager.all_steps() if self._manager else [], step, items=("params",)
      )
    except checkpoint.CheckpointError:
      self.close()
      raise
    _, self._target = sharding.abstract_params(Llama, self.cfg)
    self._path, self._value = None, None

  def __call__(self, path: tuple[str, ...]) -> np.ndarray:
    if path != self._path:
      self._path, self._value = None, None  # free the previous leaf before restoring the next
      self._value = self._restore(path)
      self._path = path
    return self._value

  def _restore(self, path: tuple[str, ...]) -> np.ndarray:
    item: dict[str, Any] = {}
    node = item
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = _leaf(self._target, path)
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
    with checkpoint.restore_errors(self.directory, self.step):
      restored = self._manager.restore(
        self.step,
        args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)),
      )
    value = _leaf(restored["params"], path)
    flat = value.reshape(-1)
    step = max(1, CHUNK_BYTES // value.itemsize)
    if not all(np.isfinite(flat[i : i + step]).all() for i in range(0, flat.size, step)):
      raise checkpoint.CheckpointError(
        f"checkpoint directory {self.directory!r} step {self.step} holds non-finite values (NaN or infinity) in "
        f"{'/'.join(path)}; use an earlier step"
      )
    return value

  def close(self) -> None:
    self._path, self._value = None, None
    if self._manager is not None:
      self._manager.close()


class _MergedLeaves:
  """The leaves of a LoRA workdir read as a plain model: each of its base's leaves (the step lora.json names, as
  `_CheckpointLeaves` reads them) with the adapter folded in, W + scale·A·B in float32 then W's dtype. The adapters
  are small and read whole; the base is still read one leaf at a time."""

  def __init__(self, directory: str, step: int | None = None):
    record = lora_lib.read_record(directory)
    lora_lib.check_base(directory, record)
    self.lora = lora_lib.config_of(record)
    self._base = _CheckpointLeaves(record["base"], record["base_step"])
    self.cfg, self.directory = self._base.cfg, directory
    try:
      self.step, self.adapters = checkpoint.read_adapters(directory, self.cfg, self.lora, step)
    except BaseException:
      self._base.close()
      raise

  def __call__(self, path: tuple[str, ...]) -> np.ndarray:
    value = self._base(path)
    name = path[-1]
    if path[0] != "layers" or name not in self.lora.targets:
      return value
    node = self.adapters["layers"][path[1]]
    change = lora_lib.delta(
      node[name + lora_lib.A_SUFFIX],
      node[name + lora_lib.B_SUFFIX],
      self.lora.scale,
      lora_lib.TARGET_MODULES[name][1],
      xp=np,
    )
    return (value.astype(np.float32) + change).astype(value.dtype)

  def close(self) -> None:
    self._base.close()


def _leaves_of(directory: str, step: int | None):
  """The params of a checkpoint directory one leaf at a time: a LoRA workdir's merged into its base."""
  return _MergedLeaves(directory, step) if lora_lib.read_record(directory) else _CheckpointLeaves(directory, step)


# ---------------------------------------------------------------------------------------------------------------------
# The conversions


def _check_new_output(out_dir: str) -> None:
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ConvertError(f"output directory {out_dir!r} exists and is not empty; choose a new one")


@contextlib.contextmanager
def _new_output_dir(out_dir: str) -> Iterator[str]:
  """A scratch directory beside `out_dir`, renamed to it on success and removed on any error: a failed conversion
  leaves nothing behind."""
  _check_new_output(out_dir)
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  # mkdir, not mkdtemp: mkdtemp's mode 0700 would become the output's; this one gets the umask's, as any new directory.
  scratch = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial-{uuid.uuid4().hex[:12]}")
  os.mkdir(scratch)
  try:
    yield scratch
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)  # empty, checked above
    os.rename(scratch, out_dir)
  except BaseException:
    shutil.rmtree(scratch, ignore_errors=True)
    raise


def _tokenizer_in(directory: str) -> str | None:
  path = os.path.join(directory, TOKENIZER_FILE)
  return path if os.path.isfile(path) else None


def from_hf(hf_dir: str, out_dir: str) -> ModelConfig:
  """HF directory → new llama_jax checkpoint directory (params at step 0, model config, tokenizer if present).
  Everything is read and checked before anything is written, and the output is written beside `out_dir` and renamed
  into place: a failure leaves no output directory."""
  _check_new_output(out_dir)
  cfg, reader = open_hf_dir(hf_dir)
  with contextlib.closing(reader):
    params = _params_from_rows(cfg, reader.read_rows, lambda name: reader.entries[name].path)
  with _new_output_dir(out_dir) as scratch:
    checkpoint.save_params_dir(scratch, cfg, params, tokenizer_path=_tokenizer_in(hf_dir))
  return cfg


def from_meta(meta_dir: str, out_dir: str) -> ModelConfig:
  """Meta's LLaMA 2 download (params.json, consolidated.NN.pth, tokenizer.model) → new llama_jax checkpoint
  directory."""
  _check_new_output(out_dir)
  shards = MetaShards(meta_dir, lambda cfg: {t.name: t.shape for t in hf_tensor_plan(cfg)})
  cfg, params = shards.cfg, _empty_params(shards.cfg)
  shards.copy_into((t.name, _hf_view(_leaf(params, t.path), t)) for t in hf_tensor_plan(cfg))
  del shards  # unmaps the .pth files
  with _new_output_dir(out_dir) as scratch:  # as from_hf: a failure leaves no output directory
    checkpoint.save_params_dir(scratch, cfg, params, tokenizer_path=_tokenizer_in(meta_dir))
  return cfg


def to_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, step: int | None = None) -> ModelConfig:
  """llama_jax checkpoint directory (latest or given step) → new HF directory; a LoRA workdir gives its merged
  weights."""
  _check_new_output(out_dir)
  check_hf_expressible(checkpoint.read_model_config(checkpoint_dir), repr(checkpoint_dir))
  with contextlib.closing(_leaves_of(checkpoint_dir, step)) as leaves, _new_output_dir(out_dir) as scratch:
    _write_hf_tensors(scratch, leaves.cfg, leaves, max_shard_bytes)
    _write_hf_metadata(scratch, leaves.cfg, _tokenizer_in(checkpoint_dir))
  return leaves.cfg


def _lora_record(directory: str) -> dict[str, Any]:
  record = lora_lib.read_record(directory)
  if record is None:
    raise ConvertError(f"{directory!r} is not a LoRA workdir: it has no {lora_lib.LORA_FILE}")
  return record


def merge_lora(checkpoint_dir: str, out_dir: str, step: int | None = None) -> ModelConfig:
  """LoRA workdir → new llama_jax checkpoint directory of the merged weights (W + scale·A·B), a plain model that
  every command reads, and a base for another run."""
  _lora_record(checkpoint_dir)
  _check_new_output(out_dir)
  with contextlib.closing(_MergedLeaves(checkpoint_dir, step)) as leaves:
    cfg = leaves.cfg
    params = jax.tree_util.tree_map_with_path(lambda path, _: leaves(tuple(k.key for k in path)), _empty_params(cfg))
  with _new_output_dir(out_dir) as scratch:
    checkpoint.save_params_dir(scratch, cfg, params, tokenizer_path=_tokenizer_in(checkpoint_dir))
  return cfg


def to_peft(checkpoint_dir: str, out_dir: str, step: int | None = None) -> ModelConfig:
  """LoRA workdir → new peft adapter directory (adapter_config.json, adapter_model.safetensors) for the HF export
  of its base (``--to_hf BASE``); ``PeftModel.from_pretrained(base, out_dir)`` then gives this model's logits."""
  import safetensors.numpy

  record = _lora_record(checkpoint_dir)
  _check_new_output(out_dir)
  lora_lib.check_base(checkpoint_dir, record)
  cfg, lora = checkpoint.read_model_config(checkpoint_dir), lora_lib.config_of(record)
  check_hf_expressible(cfg, checkpoint_dir)  # a peft adapter needs an HF base to sit on
  _, adapters = checkpoint.read_adapters(checkpoint_dir, cfg, lora, step)
  with _new_output_dir(out_dir) as scratch:
    safetensors.numpy.save_file(
      lora_lib.peft_tensors(adapters, cfg), os.path.join(scratch, "adapter_model.safetensors"), {"format": "pt"}
    )
    with open(os.path.join(scratch, "adapter_config.json"), "w") as f:
      json.dump(lora_lib.peft_config(lora, record["base"]), f, indent=2, sort_keys=True)
  return cfg


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(
    prog="python -m llama_jax.convert",
    description=__doc__.split("\n\n")[0] + " Streams tensor by tensor: peak memory stays near the model's size.",
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument(
    "--from_hf", metavar="HF_DIR", help="transformers Llama directory to read (config.json, *.safetensors)"
  )
  source.add_argument(
    "--from_meta",
    metavar="META_DIR",
    help="Meta's original LLaMA 2 download to read: params.json, consolidated.NN.pth model-parallel shards (merged; "
    "needs torch), tokenizer.model (copied when present)",
  )
  source.add_argument(
    "--to_hf",
    metavar="CKPT_DIR",
    help="llama_jax checkpoint directory to export (latest step); a LoRA workdir exports its merged weights, or with "
    "--peft its adapter",
  )
  source.add_argument(
    "--merge_lora",
    metavar="LORA_DIR",
    help="LoRA workdir → llama_jax checkpoint directory of the merged weights (base + scale·A·B)",
  )
  parser.add_argument("--out", required=True, help="new output directory (must not exist or be empty)")
  parser.add_argument("--max_shard_gib", type=float, default=5.0, help="--to_hf: largest safetensors file")
  parser.add_argument("--step", type=int, help="--to_hf, --merge_lora: checkpoint step to export (default: the latest)")
  parser.add_argument(
    "--peft",
    action="store_true",
    help="--to_hf of a LoRA workdir: write a peft adapter (adapter_config.json, adapter_model.safetensors) for the "
    "HF export of its base instead of merged weights",
  )
  args = parser.parse_args(argv)
  if args.peft and not args.to_hf:
    parser.error("--peft goes with --to_hf LORA_DIR")
  if args.from_hf:
    cfg = run_or_exit(from_hf, args.from_hf, args.out)
  elif args.from_meta:
    cfg = run_or_exit(from_meta, args.from_meta, args.out)
  elif args.merge_lora:
    cfg = run_or_exit(merge_lora, args.merge_lora, args.out, args.step)
  elif args.peft:
    cfg = run_or_exit(to_peft, args.to_hf, args.out, args.step)
    print(f"wrote {args.out}: a peft LoRA adapter for the HF export of its base")
    return 0
  else:
    cfg = run_or_exit(to_hf, args.to_hf, args.out, int(args.max_shard_gib * 2**30), args.step)
  print(f"wrote {args.out}: {cfg.num_params():,} parameters, {cfg.n_layers} layers, dim {cfg.dim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
