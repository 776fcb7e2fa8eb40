"""Weights in and out: HF transformers Llama directories and Meta's original LLaMA 2 downloads → llama_jax checkpoint
directories, and llama_jax checkpoints → HF directories.

    python -m llama_jax.convert --from_hf HF_DIR --out CKPT_DIR      # config.json + (sharded) *.safetensors
    python -m llama_jax.convert --from_meta META_DIR --out CKPT_DIR  # params.json + consolidated.NN.pth (needs torch)
    python -m llama_jax.convert --to_hf CKPT_DIR --out HF_DIR        # → config.json + *.safetensors for transformers

Conversion streams tensor by tensor, so peak host memory stays near the model's bytes (bench/convert_memory.py
measures it): --from_hf reads each safetensors tensor from its file in pieces straight into preallocated stacked
[L, ...] arrays, --from_meta copies from memory-mapped .pth shards the same way, and --to_hf restores one parameter at
a time and writes each HF tensor in pieces. Everything is checked before the output directory is created.

RoPE layout: llama_jax rotates the two halves of each head (HF's ``rotate_half``), so HF weights map by transposes and
reshapes only, and a round trip is bit-exact. Meta's original ``consolidated.*.pth`` weights rotate interleaved pairs
(x0,x1), (x2,x3)...; --from_meta permutes the rows of wq and wk with ``permute_meta_qk`` (the same permutation HF's own
conversion script applies). Meta's model-parallel shards split the column-parallel weights (wq, wk, wv, w1, w3,
output) on dim 0 and the row-parallel ones (wo, w2, tok_embeddings) on dim 1; norms are replicated.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from llama_jax import checkpoint
from llama_jax.cli import ArgumentParser
from llama_jax.config import ConfigError, ModelConfig
from llama_jax.errors import LlamaJaxError, run_or_exit
from llama_jax.tokenizer import TOKENIZER_FILE

INDEX_FILE = "model.safetensors.index.json"
META_PARAMS_FILE = "params.json"
_DTYPES_FROM_HF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_SAFETENSORS_DTYPES = {"F32": np.dtype("float32"), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("float16")}
_SAFETENSORS_NAMES = {dtype.name: name for name, dtype in _SAFETENSORS_DTYPES.items()}
# Tensors are moved in row blocks of about this size: the only temporaries a conversion allocates besides the model.
_CHUNK_BYTES = 8 * 2**20


class ConvertError(LlamaJaxError, ValueError):
  """The input cannot be converted; the message names the file, tensor or value."""


def permute_meta_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Meta's interleaved-pair rows of a q/k projection [n_heads·H, D] → the half-split layout used here (and by HF)."""
  rows, dim = w.shape
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, dim).transpose(0, 2, 1, 3).reshape(rows, dim)


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """ModelConfig from a transformers Llama ``config.json``; features llama_jax lacks are refused by name."""
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ConvertError(f"config.json sets {key}=true; LLaMA 2 has no biases and llama_jax does not support them")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConvertError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
  dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, dim // n_heads):
    raise ConvertError(
      f"config.json head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
      f"{dim // n_heads}; not supported"
    )
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in _DTYPES_FROM_HF:
    raise ConvertError(f"config.json dtype {dtype!r} is not one of {sorted(_DTYPES_FROM_HF)}")
  rope = dict(hf.get("rope_scaling") or {})
  # transformers ≥ 5 keeps theta and scaling together in rope_parameters.
  rope_parameters = dict(hf.get("rope_parameters") or {})
  theta = rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
  if rope_parameters.get("rope_type", "default") != "default":
    rope = rope_parameters
  kind = rope.get("rope_type", rope.get("type", "none")) if rope else "none"
  kind = "none" if kind == "default" else kind
  fields = dict(
    vocab_size=hf["vocab_size"],
    dim=dim,
    n_layers=hf["num_hidden_layers"],
    n_heads=n_heads,
    n_kv_heads=hf.get("num_key_value_heads") or n_heads,
    ffn_hidden_dim=hf["intermediate_size"],
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope_theta=float(theta),
    max_seq_len=hf.get("max_position_embeddings", 4096),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    dtype=_DTYPES_FROM_HF[dtype],
    param_dtype=_DTYPES_FROM_HF[dtype],
    rope_scaling=kind,
  )
  if kind in ("linear", "llama3"):
    fields["rope_scaling_factor"] = float(rope["factor"])
  if kind == "llama3":
    fields.update(
      rope_low_freq_factor=float(rope["low_freq_factor"]),
      rope_high_freq_factor=float(rope["high_freq_factor"]),
      rope_original_max_len=int(rope["original_max_position_embeddings"]),
    )
  try:
    return ModelConfig(**fields)
  except ConfigError as e:
    raise ConvertError(f"config.json does not describe a valid model: {e}") from e


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


def _row_blocks(tensor: HFTensor) -> Iterator[tuple[int, int]]:
  """[start, stop) blocks of the HF tensor's rows, each about _CHUNK_BYTES in float32."""
  rows = tensor.shape[0]
  step = max(1, _CHUNK_BYTES // (4 * math.prod(tensor.shape[1:])))
  for start in range(0, rows, step):
    yield start, min(rows, start + step)


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


def _check_hf_tensors(shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig) -> None:
  plan = hf_tensor_plan(cfg)
  missing = [t.name for t in plan if t.name not in shapes]
  if missing:
    raise ConvertError(f"{len(missing)} tensors missing from the safetensors files, e.g. {missing[0]!r}")
  for t in plan:
    if tuple(shapes[t.name]) != t.shape:
      raise ConvertError(f"tensor {t.name!r} has shape {tuple(shapes[t.name])}, but config.json implies {t.shape}")


def _params_from_rows(cfg: ModelConfig, read_rows: Callable[[str, int, int], np.ndarray]) -> dict[str, Any]:
  """Fills a new params tree HF tensor by HF tensor, block of rows by block; values are cast to cfg.param_dtype."""
  params = _empty_params(cfg)
  for tensor in hf_tensor_plan(cfg):
    hf = _hf_view(_leaf(params, tensor.path), tensor)
    for start, stop in _row_blocks(tensor):
      hf[start:stop] = read_rows(tensor.name, start, stop)
  return params


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """HF tensors (name → [out, in] arrays) → the llama_jax params tree (numpy, layers stacked on axis 0)."""
  _check_hf_tensors({name: np.shape(a) for name, a in tensors.items()}, cfg)
  return _params_from_rows(cfg, lambda name, start, stop: np.asarray(tensors[name][start:stop]))


def hf_from_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of ``params_from_hf``: contiguous HF-layout arrays named as transformers names them."""
  return {t.name: np.ascontiguousarray(_hf_view(np.asarray(_leaf(params, t.path)), t)) for t in hf_tensor_plan(cfg)}


# ---------------------------------------------------------------------------------------------------------------------
# safetensors, read and written a block of rows at a time. The format: 8-byte little-endian header length, a JSON
# header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the raw bytes. Plain reads rather than a
# memory map: a mapped file's pages would count towards the process's memory until it is closed.


class _SafetensorsEntry(NamedTuple):
  path: str
  offset: int  # of the first byte, from the start of the file
  dtype: str  # safetensors' name: F32, BF16 ...
  shape: tuple[int, ...]


def _safetensors_entries(path: str) -> dict[str, _SafetensorsEntry]:
  size = os.path.getsize(path)
  try:
    with open(path, "rb") as f:
      header_len = int.from_bytes(f.read(8), "little")
      if not 0 < header_len <= size - 8:
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
      header = json.loads(f.read(header_len))
    entries = {}
    for name, info in header.items():
      if name == "__metadata__":
        continue
      begin, end = info["data_offsets"]
      shape = tuple(int(n) for n in info["shape"])
      itemsize = _SAFETENSORS_DTYPES[info["dtype"]].itemsize if info["dtype"] in _SAFETENSORS_DTYPES else None
      if itemsize and end - begin != math.prod(shape) * itemsize:
        raise ValueError(f"tensor {name!r} of shape {shape} has {end - begin} bytes")
      if 8 + header_len + end > size:
        raise ValueError(f"tensor {name!r} ends past the end of the file (truncated?)")
      entries[name] = _SafetensorsEntry(path, 8 + header_len + begin, info["dtype"], shape)
    return entries
  except (ValueError, KeyError, TypeError) as e:
    raise ConvertError(f"{path} is not a readable safetensors file: {e}") from e


class _SafetensorsReader:
  """The tensors of one or more safetensors files, read a block of rows at a time."""

  def __init__(self, paths: list[str]):
    self.entries: dict[str, _SafetensorsEntry] = {}
    for path in paths:
      self.entries.update(_safetensors_entries(path))
    self._files: dict[str, Any] = {}

  def dtype(self, name: str) -> np.dtype:
    entry = self.entries[name]
    if entry.dtype not in _SAFETENSORS_DTYPES:
      raise ConvertError(
        f"tensor {name!r} in {entry.path} has dtype {entry.dtype}; only {sorted(_SAFETENSORS_DTYPES)} are read"
      )
    return _SAFETENSORS_DTYPES[entry.dtype]

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    entry, dtype = self.entries[name], self.dtype(name)
    rows = np.empty((stop - start, *entry.shape[1:]), dtype)
    if entry.path not in self._files:
      self._files[entry.path] = open(entry.path, "rb")  # closed by close()
    f = self._files[entry.path]
    f.seek(entry.offset + start * math.prod(entry.shape[1:]) * dtype.itemsize)
    f.readinto(rows.reshape(-1).view(np.uint8))
    return rows

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files.clear()


def _write_safetensors(path: str, tensors: list[HFTensor], dtype: np.dtype, hf_of: Callable[[HFTensor], np.ndarray]):
  """One safetensors file of `tensors`, each written a block of rows at a time from its view `hf_of(tensor)`."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without "format"
  offset = 0
  for t in tensors:
    nbytes = math.prod(t.shape) * dtype.itemsize
    header[t.name] = {
      "dtype": _SAFETENSORS_NAMES[dtype.name],
      "shape": list(t.shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
  with open(path, "wb") as f:
    f.write(len(encoded).to_bytes(8, "little"))
    f.write(encoded)
    for t in tensors:
      hf = hf_of(t)
      for start, stop in _row_blocks(t):
        f.write(np.ascontiguousarray(hf[start:stop], dtype=dtype).reshape(-1).view(np.uint8))


def _write_hf_tensors(
  out_dir: str, cfg: ModelConfig, leaf_of: Callable[[tuple[str, ...]], np.ndarray], max_shard_bytes: int
) -> None:
  """model.safetensors, or files of at most `max_shard_bytes` with an index, asking `leaf_of` for each params leaf
  in the plan's order (each leaf once)."""
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)
  shards, current, size = [], [], 0
  for t in hf_tensor_plan(cfg):
    nbytes = math.prod(t.shape) * dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(t)
    size += nbytes

  def hf_of(t: HFTensor) -> np.ndarray:
    return _hf_view(leaf_of(t.path), t)

  shards.append(current)
  if len(shards) == 1:
    _write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0], dtype, hf_of)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    _write_safetensors(os.path.join(out_dir, name), shard, dtype, hf_of)
    weight_map.update({t.name: name for t in shard})
  total = sum(math.prod(t.shape) for shard in shards for t in shard) * dtype.itemsize
  with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------------------------------------------------
# HF directories


def open_hf_dir(hf_dir: str) -> tuple[ModelConfig, _SafetensorsReader]:
  """config.json plus single or sharded (index.json) safetensors of a transformers Llama directory, checked against
  each other (names, shapes, dtypes) from the file headers alone."""
  if not os.path.isdir(hf_dir):
    raise ConvertError(f"HF directory {hf_dir!r} does not exist")
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(config_path):
    raise ConvertError(f"{hf_dir!r} has no config.json")
  with open(config_path) as f:
    hf_config = json.load(f)
  if hf_config.get("model_type", "llama") != "llama":
    raise ConvertError(f"{config_path} has model_type={hf_config['model_type']!r}; only 'llama' is supported")
  cfg = model_config_from_hf(hf_config)
  index_path = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    files = [os.path.join(hf_dir, name) for name in files]
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise ConvertError(f"{hf_dir!r} has no *.safetensors files (PyTorch .bin files are not read: no torch here)")
  for path in files:
    if not os.path.isfile(path):
      raise ConvertError(f"{INDEX_FILE} names {os.path.basename(path)!r}, which is missing from {hf_dir!r}")
  reader = _SafetensorsReader(files)
  if cfg.tie_embeddings:
    reader.entries.pop("lm_head.weight", None)  # some exporters write the tied head too; it is the embedding
  _check_hf_tensors({name: entry.shape for name, entry in reader.entries.items()}, cfg)
  dtypes = sorted({reader.dtype(t.name).name for t in hf_tensor_plan(cfg)})
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


# ---------------------------------------------------------------------------------------------------------------------
# Meta's original LLaMA 2 download: params.json + consolidated.NN.pth model-parallel shards

# Meta name suffix → (HF name suffix, the dimension model parallelism splits: 0 column-parallel, 1 row-parallel,
# None replicated).
_META_LAYER_TENSORS = {
  "attention_norm.weight": ("input_layernorm.weight", None),
  "attention.wq.weight": ("self_attn.q_proj.weight", 0),
  "attention.wk.weight": ("self_attn.k_proj.weight", 0),
  "attention.wv.weight": ("self_attn.v_proj.weight", 0),
  "attention.wo.weight": ("self_attn.o_proj.weight", 1),
  "ffn_norm.weight": ("post_attention_layernorm.weight", None),
  "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0),
  "feed_forward.w3.weight": ("mlp.up_proj.weight", 0),
  "feed_forward.w2.weight": ("mlp.down_proj.weight", 1),
}
_META_TOP_TENSORS = {
  "tok_embeddings.weight": ("model.embed_tokens.weight", 1),
  "norm.weight": ("model.norm.weight", None),
  "output.weight": ("lm_head.weight", 0),
}
_META_IGNORED = ("rope.freqs",)  # precomputed rotary frequencies, recomputed here from rope_theta
_META_REQUIRED = ("dim", "n_layers", "n_heads", "multiple_of", "norm_eps")
_META_SHARD = re.compile(r"consolidated\.(\d+)\.pth")


def _meta_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
  """HF name → (Meta name, split dimension) of every tensor."""
  names = {hf: (meta, dim) for meta, (hf, dim) in _META_TOP_TENSORS.items()}
  for i in range(cfg.n_layers):
    names.update({f"model.layers.{i}.{hf}": (f"layers.{i}.{meta}", d) for meta, (hf, d) in _META_LAYER_TENSORS.items()})
  return names


def model_config_from_meta(meta: Mapping[str, Any], vocab_size: int, dtype: str, where: str) -> ModelConfig:
  """ModelConfig from Meta's ``params.json``: the MLP width follows Meta's rule (multiple_of, ffn_dim_multiplier)."""
  if meta.get("use_scaled_rope"):
    raise ConvertError(
      f"{where} sets use_scaled_rope (Llama 3.1 rope scaling); --from_meta reads LLaMA 2 only: convert the HF release "
      "with --from_hf"
    )
  try:
    return ModelConfig(
      vocab_size=vocab_size,
      dim=meta["dim"],
      n_layers=meta["n_layers"],
      n_heads=meta["n_heads"],
      n_kv_heads=meta.get("n_kv_heads"),
      multiple_of=meta["multiple_of"],
      ffn_dim_multiplier=meta.get("ffn_dim_multiplier"),
      norm_eps=meta["norm_eps"],
      rope_theta=meta.get("rope_theta", 10000.0),
      dtype=dtype,
      param_dtype=dtype,
    )
  except (ConfigError, TypeError) as e:
    raise ConvertError(f"{where} does not describe a valid model: {e}") from e


def _meta_shard_paths(meta_dir: str) -> list[str]:
  numbers = {}
  for path in glob.glob(os.path.join(meta_dir, "consolidated.*.pth")):
    match = _META_SHARD.fullmatch(os.path.basename(path))
    if match:
      numbers.setdefault(int(match.group(1)), []).append(path)
  if not numbers:
    raise ConvertError(f"{meta_dir!r} has no consolidated.NN.pth files")
  for number, paths in sorted(numbers.items()):
    if len(paths) > 1:
      raise ConvertError(f"{meta_dir!r} has two shards numbered {number}: {sorted(map(os.path.basename, paths))}")
  missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
  if missing:
    present = ", ".join(os.path.basename(numbers[n][0]) for n in sorted(numbers))
    raise ConvertError(
      f"{meta_dir!r} has {present} but no consolidated.{missing[0]:02d}.pth: a model-parallel shard is missing"
    )
  return [numbers[n][0] for n in sorted(numbers)]


def _torch_numpy(tensor: Any) -> np.ndarray:
  """A numpy view of a CPU torch tensor (bfloat16 through its bits: numpy has no bfloat16 of its own)."""
  import torch

  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


class _MetaShards:
  """Meta's model-parallel shards, memory-mapped, checked against params.json before anything is read."""

  def __init__(self, meta_dir: str):
    if not os.path.isdir(meta_dir):
      raise ConvertError(f"Meta directory {meta_dir!r} does not exist")
    params_path = os.path.join(meta_dir, META_PARAMS_FILE)
    if not os.path.isfile(params_path):
      raise ConvertError(f"{meta_dir!r} has no {META_PARAMS_FILE}")
    try:
      with open(params_path) as f:
        meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConvertError(f"{params_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
      raise ConvertError(f"{params_path} holds a JSON {type(meta).__name__}, not an object")
    missing = [key for key in _META_REQUIRED if key not in meta]
    if missing:
      raise ConvertError(f"{params_path} has no {missing[0]!r} (required: {', '.join(_META_REQUIRED)})")
    vocab_size = meta.get("vocab_size", -1)
    # Meta writes vocab_size -1 (set from the tokenizer at run time): the embedding's rows give it, once read.
    model_config_from_meta(meta, 1 if vocab_size == -1 else vocab_size, "float32", params_path)
    self.paths = _meta_shard_paths(meta_dir)
    try:
      import torch
    except ImportError as e:
      raise ConvertError("--from_meta needs torch to read .pth files: pip install torch") from e
    self.shards = []
    for path in self.paths:
      try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
      except Exception as e:  # torch raises many types for a damaged or foreign file; the message says which
        raise ConvertError(f"cannot read {path}: {str(e).strip().splitlines()[0]}") from e
      if not isinstance(shard, dict) or not all(isinstance(t, torch.Tensor) for t in shard.values()):
        raise ConvertError(f"{path} does not hold a state dict of tensors")
      self.shards.append(shard)
    self.cfg = self._config(meta, vocab_size, params_path)
    self._check_shapes()

  def _config(self, meta: Mapping[str, Any], vocab_size: int, params_path: str) -> ModelConfig:
    import torch

    first = os.path.basename(self.paths[0])
    if "tok_embeddings.weight" not in self.shards[0]:
      raise ConvertError(f"{first} has no tensor 'tok_embeddings.weight'")
    if vocab_size == -1:
      vocab_size = int(self.shards[0]["tok_embeddings.weight"].shape[0])
    known = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    dtypes = set()
    for path, shard in zip(self.paths, self.shards):
      for name, tensor in shard.items():
        if name in _META_IGNORED:
          continue
        if tensor.dtype not in known:
          raise ConvertError(
            f"{os.path.basename(path)}: {name} has dtype {tensor.dtype}; expected float32/16, bfloat16"
          )
        dtypes.add(known[tensor.dtype])
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"  # keep the stored dtype; a mixture is read as float32
    return model_config_from_meta(meta, vocab_size, dtype, params_path)

  def _check_shapes(self) -> None:
    cfg, files = self.cfg, [os.path.basename(p) for p in self.paths]
    names = _meta_names(cfg)
    known = {meta for meta, _ in names.values()} | set(_META_IGNORED)
    for file, shard in zip(files, self.shards):
      for name in shard:
        if name not in known:
          raise ConvertError(
            f"{file} holds {name!r}, which is not part of the LLaMA 2 model params.json describes "
            f"(n_layers={cfg.n_layers})"
          )
    w1_rows = sum(self.piece_shape(i, "layers.0.feed_forward.w1.weight")[0] for i in range(len(files)))
    if w1_rows != cfg.hidden_dim:
      raise ConvertError(
        f"layers.0.feed_forward.w1.weight has {w1_rows} rows (the MLP width), but params.json's "
        f"dim={cfg.dim}, multiple_of={cfg.multiple_of}, ffn_dim_multiplier={cfg.ffn_dim_multiplier} give "
        f"{cfg.hidden_dim} by Meta's rule"
      )
    for t in hf_tensor_plan(cfg):
      meta_name, dim = names[t.name]
      shapes = [self.piece_shape(i, meta_name) for i in range(len(files))]
      for file, shape in zip(files[1:], shapes[1:]):
        if len(shape) != len(shapes[0]) or any(
          a != b for axis, (a, b) in enumerate(zip(shape, shapes[0])) if axis != dim
        ):
          raise ConvertError(f"{meta_name} has shape {shape} in {file} but {shapes[0]} in {files[0]}")
      merged = list(shapes[0])
      if dim is not None:
        merged[dim] = sum(shape[dim] for shape in shapes)
      if tuple(merged) != t.shape:
        raise ConvertError(
          f"{meta_name} merges to {tuple(merged)} from {len(files)} shard(s), but params.json implies {t.shape}"
        )
      if meta_name.endswith(("wq.weight", "wk.weight")) and any(shape[0] % cfg.head_dim for shape in shapes):
        raise ConvertError(
          f"{meta_name} splits into {[s[0] for s in shapes]} rows, not whole heads of {cfg.head_dim} rows"
        )

  def piece_shape(self, index: int, name: str) -> tuple[int, ...]:
    if name not in self.shards[index]:
      raise ConvertError(f"{os.path.basename(self.paths[index])} has no tensor {name!r}")
    return tuple(self.shards[index][name].shape)

  def params(self) -> dict[str, Any]:
    """The merged params tree, copied piece by piece from the mapped shards (q/k rows permuted to half rotation)."""
    cfg, names = self.cfg, _meta_names(self.cfg)
    params = _empty_params(cfg)
    for t in hf_tensor_plan(cfg):
      meta_name, dim = names[t.name]
      hf = _hf_view(_leaf(params, t.path), t)
      offset = 0
      for shard in self.shards[: 1 if dim is None else None]:
        piece = _torch_numpy(shard[meta_name])
        if meta_name.endswith(("wq.weight", "wk.weight")):
          piece = permute_meta_qk(piece, piece.shape[0] // cfg.head_dim)
        if dim is None:
          hf[...] = piece
        elif dim == 0:
          hf[offset : offset + piece.shape[0]] = piece
        else:
          hf[:, offset : offset + piece.shape[1]] = piece
        offset += 0 if dim is None else piece.shape[dim]
        _release_pages(shard[meta_name])
    return params


def _release_pages(tensor: Any) -> None:
  """Hands a memory-mapped tensor's pages back to the kernel once copied (Linux ≥ 5.4, best effort), so that the
  mapped shards do not add up to a second copy of the model in this process's resident memory (measured: 2.05× the
  model without, 1.15× with). MADV_PAGEOUT rather than MADV_DONTNEED: it never discards data, mapped or not."""
  if sys.platform != "linux" or tensor.numel() == 0:
    return
  import ctypes
  import mmap

  start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
  end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
  ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT


# ---------------------------------------------------------------------------------------------------------------------
# llama_jax checkpoints, one params leaf at a time


class _CheckpointLeaves:
  """The params of the latest complete step of a checkpoint directory, restored one leaf at a time as numpy (and
  refused if non-finite, as ``checkpoint.load_params`` does), so that exporting never holds the whole model twice."""

  def __init__(self, directory: str):
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
    steps = self._manager.all_steps() if self._manager else []
    if not steps:
      self.close()
      raise checkpoint.CheckpointError(f"checkpoint directory {directory!r} holds no complete checkpoint step")
    self.step = max(steps)
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
    restored = self._manager.restore(
      self.step,
      args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)),
    )
    value = _leaf(restored["params"], path)
    flat = value.reshape(-1)
    step = max(1, _CHUNK_BYTES // value.itemsize)
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


# ---------------------------------------------------------------------------------------------------------------------
# The three conversions


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
  scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-", dir=parent)
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
  """HF directory → new llama_jax checkpoint directory (params at step 0, model config, tokenizer if present)."""
  _check_new_output(out_dir)
  cfg, reader = open_hf_dir(hf_dir)
  with contextlib.closing(reader):
    params = _params_from_rows(cfg, reader.read_rows)
  checkpoint.save_params_dir(out_dir, cfg, params, tokenizer_path=_tokenizer_in(hf_dir))
  return cfg


def from_meta(meta_dir: str, out_dir: str) -> ModelConfig:
  """Meta's LLaMA 2 download (params.json, consolidated.NN.pth, tokenizer.model) → new llama_jax checkpoint
  directory."""
  _check_new_output(out_dir)
  shards = _MetaShards(meta_dir)
  cfg, params = shards.cfg, shards.params()
  del shards  # unmaps the .pth files
  checkpoint.save_params_dir(out_dir, cfg, params, tokenizer_path=_tokenizer_in(meta_dir))
  return cfg


def to_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> ModelConfig:
  """llama_jax checkpoint directory (latest step) → new HF directory."""
  _check_new_output(out_dir)
  with contextlib.closing(_CheckpointLeaves(checkpoint_dir)) as leaves, _new_output_dir(out_dir) as scratch:
    _write_hf_tensors(scratch, leaves.cfg, leaves, max_shard_bytes)
    _write_hf_metadata(scratch, leaves.cfg, _tokenizer_in(checkpoint_dir))
  return leaves.cfg


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
  source.add_argument("--to_hf", metavar="CKPT_DIR", help="llama_jax checkpoint directory to export (latest step)")
  parser.add_argument("--out", required=True, help="new output directory (must not exist or be empty)")
  parser.add_argument("--max_shard_gib", type=float, default=5.0, help="--to_hf: largest safetensors file")
  args = parser.parse_args(argv)
  if args.from_hf:
    cfg = run_or_exit(from_hf, args.from_hf, args.out)
  elif args.from_meta:
    cfg = run_or_exit(from_meta, args.from_meta, args.out)
  else:
    cfg = run_or_exit(to_hf, args.to_hf, args.out, int(args.max_shard_gib * 2**30))
  print(f"wrote {args.out}: {cfg.num_params():,} parameters, {cfg.n_layers} layers, dim {cfg.dim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
