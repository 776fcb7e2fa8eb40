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
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from llama_jax import checkpoint, safetensors_stream
from llama_jax.cli import ArgumentParser
from llama_jax.config import ConfigError, ModelConfig
from llama_jax.errors import LlamaJaxError, run_or_exit
from llama_jax.meta_checkpoint import MetaShards, permute_meta_qk  # noqa: F401 (permute_meta_qk: known from here too)
from llama_jax.safetensors_stream import CHUNK_BYTES, INDEX_FILE, row_blocks
from llama_jax.tokenizer import TOKENIZER_FILE, Tokenizer

_DTYPES_FROM_HF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ConvertError(LlamaJaxError, ValueError):
  """The input cannot be converted; the message names the file, tensor or value."""


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
    for start, stop in row_blocks(tensor.shape):
      hf[start:stop] = read_rows(tensor.name, start, stop)
  return params


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """HF tensors (name → [out, in] arrays) → the llama_jax params tree (numpy, layers stacked on axis 0)."""
  _check_hf_tensors({name: np.shape(a) for name, a in tensors.items()}, cfg)
  return _params_from_rows(cfg, lambda name, start, stop: np.asarray(tensors[name][start:stop]))


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


def open_hf_dir(hf_dir: str) -> tuple[ModelConfig, safetensors_stream.Reader]:
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
  reader = safetensors_stream.Reader(files)
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
  shards = MetaShards(meta_dir, lambda cfg: {t.name: t.shape for t in hf_tensor_plan(cfg)})
  cfg, params = shards.cfg, _empty_params(shards.cfg)
  shards.copy_into((t.name, _hf_view(_leaf(params, t.path), t)) for t in hf_tensor_plan(cfg))
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
