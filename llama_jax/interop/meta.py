"""Meta's original LLaMA 2 and Llama 3.x downloads (params.json + consolidated.NN.pth model-parallel shards) read into
HF-layout tensors, and ``from_meta``: such a download → a llama_jax checkpoint directory (``python -m
llama_jax.convert --from_meta``).

RoPE layout: Meta's weights rotate interleaved pairs (x0,x1), (x2,x3)...; llama_jax (like HF) rotates the two halves
of each head, so the rows of wq and wk are permuted with ``permute_meta_qk`` (the same permutation HF's own conversion
script applies). Meta's model-parallel shards split the column-parallel weights (wq, wk, wv, w1, w3, output) on dim 0
and the row-parallel ones (wo, w2, tok_embeddings) on dim 1; norms are replicated.

The shards are memory-mapped (torch, imported only here and only when needed) and copied piece by piece into arrays
the caller owns; each piece's pages are handed back to the kernel once copied, so peak memory stays near the model's
bytes. Everything is checked against params.json before a tensor is copied (a stored tensor the model has no place for,
such as an extra layer or an unknown name, a missing one, shapes that do not merge, an unreadable shard), and each
piece is checked to be finite as it is copied: the one sign of damaged data a .pth file gives. Which HF tensors a model
has, and where they live in the params tree, is hf.py's: `from_meta` passes their shapes and the arrays to fill.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.checks import ConfigError
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.model_config import ModelConfig
from llama_jax.interop.hf import empty_params, hf_tensor_plan, hf_view, leaf_at
from llama_jax.interop.output import check_new_output, new_output_dir, tokenizer_in
from llama_jax.interop.safetensors_stream import row_blocks

PARAMS_FILE = "params.json"

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
# (dim, n_layers) of Llama 3.2's text models, 1B and 3B: their RoPE scaling factor is 32, not 3.1's 8.
_LLAMA32_SHAPES = ((2048, 16), (3072, 28))
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+")  # a tiktoken BPE table's line: base64 token, space, rank
_META_SHARD = re.compile(r"consolidated\.(\d+)\.pth")


class MetaCheckpointError(LlamaJaxError, ValueError):
  """Meta's download cannot be read; the message names the file, tensor or value."""


def permute_meta_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Meta's interleaved-pair rows of a q/k projection [n_heads·H, D] → the half-split layout used here (and by HF)."""
  rows, dim = w.shape
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, dim).transpose(0, 2, 1, 3).reshape(rows, dim)


def meta_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
  """HF name → (Meta name, split dimension) of every tensor."""
  names = {hf: (meta, dim) for meta, (hf, dim) in _META_TOP_TENSORS.items()}
  for i in range(cfg.n_layers):
    names.update({f"model.layers.{i}.{hf}": (f"layers.{i}.{meta}", d) for meta, (hf, d) in _META_LAYER_TENSORS.items()})
  return names


def model_config_from_meta(meta: Mapping[str, Any], vocab_size: int, dtype: str, where: str) -> ModelConfig:
  """ModelConfig from Meta's ``params.json``: the MLP width follows Meta's rule (multiple_of, ffn_dim_multiplier).

  ``use_scaled_rope`` (Llama 3.1 and 3.2) is Meta's llama3 RoPE scaling, whose constants live in Meta's code, not in
  the file: low/high frequency factors 1 and 4 and an original context of 8,192, with factor 8 for 3.1 and 32 for
  3.2's 1B and 3B (told apart by their shapes, as HF's conversion tells them apart by version) unless params.json
  names one (``rope_scaling_factor``). Those releases read 131,072 positions, so that is max_seq_len."""
  scaled = meta.get("use_scaled_rope", False)
  if not isinstance(scaled, bool):
    raise MetaCheckpointError(f"{where} use_scaled_rope must be true or false, got {scaled!r}")
  rope = {}
  if scaled:
    llama32 = (meta.get("dim"), meta.get("n_layers")) in _LLAMA32_SHAPES
    factor = meta.get("rope_scaling_factor", 32.0 if llama32 else 8.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1:
      raise MetaCheckpointError(f"{where} rope_scaling_factor must be a number ≥ 1, got {factor!r}")
    rope = dict(
      rope_scaling="llama3",
      rope_scaling_factor=float(factor),
      rope_low_freq_factor=1.0,
      rope_high_freq_factor=4.0,
      rope_original_max_len=8192,
      max_seq_len=131072,
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
      **rope,
    )
  except (ConfigError, TypeError) as e:
    raise MetaCheckpointError(f"{where} does not describe a valid model: {e}") from e


def _meta_shard_paths(meta_dir: str) -> list[str]:
  numbers = {}
  for path in glob.glob(os.path.join(meta_dir, "consolidated.*.pth")):
    match = _META_SHARD.fullmatch(os.path.basename(path))
    if match:
      numbers.setdefault(int(match.group(1)), []).append(path)
  if not numbers:
    raise MetaCheckpointError(f"{meta_dir!r} has no consolidated.NN.pth files")
  for number, numbered in sorted(numbers.items()):
    if len(numbered) > 1:
      raise MetaCheckpointError(
        f"{meta_dir!r} has two shards numbered {number}: {sorted(map(os.path.basename, numbered))}"
      )
  missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
  if missing:
    present = ", ".join(os.path.basename(numbers[n][0]) for n in sorted(numbers))
    raise MetaCheckpointError(
      f"{meta_dir!r} has {present} but no consolidated.{missing[0]:02d}.pth: a model-parallel shard is missing"
    )
  return [numbers[n][0] for n in sorted(numbers)]


def _torch_numpy(tensor: Any) -> np.ndarray:
  """A numpy view of a CPU torch tensor (bfloat16 through its bits: numpy has no bfloat16 of its own)."""
  import torch

  tensor = tensor.detach()  # a saved nn.Parameter loads with requires_grad, which numpy() refuses
  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


class MetaShards:
  """Meta's model-parallel shards, memory-mapped, checked against params.json before anything is read.

  `hf_shapes(cfg)` gives the HF shape ([out, in]) of every HF tensor the model has, in the order to check them."""

  def __init__(self, meta_dir: str, hf_shapes: Callable[[ModelConfig], Mapping[str, tuple[int, ...]]]):
    if not os.path.isdir(meta_dir):
      raise MetaCheckpointError(f"Meta directory {meta_dir!r} does not exist")
    params_path = os.path.join(meta_dir, PARAMS_FILE)
    if not os.path.isfile(params_path):
      raise MetaCheckpointError(f"{meta_dir!r} has no {PARAMS_FILE}")
    try:
      with open(params_path) as f:
        meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise MetaCheckpointError(f"{params_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
      raise MetaCheckpointError(f"{params_path} holds a JSON {type(meta).__name__}, not an object")
    missing = [key for key in _META_REQUIRED if key not in meta]
    if missing:
      raise MetaCheckpointError(f"{params_path} has no {missing[0]!r} (required: {', '.join(_META_REQUIRED)})")
    vocab_size = meta.get("vocab_size", -1)
    # Meta writes vocab_size -1 (set from the tokenizer at run time): the embedding's rows give it, once read.
    model_config_from_meta(meta, 1 if vocab_size == -1 else vocab_size, "float32", params_path)
    self.paths = _meta_shard_paths(meta_dir)
    try:
      import torch
    except ImportError as e:
      raise MetaCheckpointError("--from_meta needs torch to read .pth files: pip install torch") from e
    self.shards = []
    for path in self.paths:
      try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
      except Exception as e:  # torch raises many types for a damaged or foreign file; the message says which
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MetaCheckpointError(f"cannot read {path} (damaged, truncated or not a torch.save file): {reason}") from e
      if not isinstance(shard, dict) or not all(isinstance(t, torch.Tensor) for t in shard.values()):
        raise MetaCheckpointError(f"{path} does not hold a state dict of tensors")
      self.shards.append(shard)
    self.cfg = self._config(meta, vocab_size, params_path)
    self._check_shapes(hf_shapes(self.cfg))

  def _config(self, meta: Mapping[str, Any], vocab_size: int, params_path: str) -> ModelConfig:
    import torch

    first = os.path.basename(self.paths[0])
    if "tok_embeddings.weight" not in self.shards[0]:
      raise MetaCheckpointError(f"{first} has no tensor 'tok_embeddings.weight'")
    embedding_shape = tuple(self.shards[0]["tok_embeddings.weight"].shape)
    if len(embedding_shape) != 2:
      raise MetaCheckpointError(f"{first}: tok_embeddings.weight has shape {embedding_shape}, not [vocab, dim]")
    if vocab_size == -1:
      vocab_size = embedding_shape[0]
    known = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    dtypes = set()
    for path, shard in zip(self.paths, self.shards):
      for name, tensor in shard.items():
        if name in _META_IGNORED:
          continue
        if tensor.dtype not in known:
          raise MetaCheckpointError(
            f"{os.path.basename(path)}: {name} has dtype {tensor.dtype}; expected float32/16, bfloat16"
          )
        dtypes.add(known[tensor.dtype])
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"  # keep the stored dtype; a mixture is read as float32
    return model_config_from_meta(meta, vocab_size, dtype, params_path)

  def _check_shapes(self, hf_shapes: Mapping[str, tuple[int, ...]]) -> None:
    cfg, files = self.cfg, [os.path.basename(p) for p in self.paths]
    names = meta_names(cfg)
    known = {meta for meta, _ in names.values()} | set(_META_IGNORED)
    for file, shard in zip(files, self.shards):
      for name in shard:
        if name not in known:
          raise MetaCheckpointError(
            f"{file} holds {name!r}, which is not part of the LLaMA 2 model params.json describes "
            f"(n_layers={cfg.n_layers})"
          )
    w1_rows = sum((self.piece_shape(i, "layers.0.feed_forward.w1.weight") or (0,))[0] for i in range(len(files)))
    if w1_rows != cfg.hidden_dim:
      raise MetaCheckpointError(
        f"layers.0.feed_forward.w1.weight has {w1_rows} rows (the MLP width), but params.json's "
        f"dim={cfg.dim}, multiple_of={cfg.multiple_of}, ffn_dim_multiplier={cfg.ffn_dim_multiplier} give "
        f"{cfg.hidden_dim} by Meta's rule"
      )
    for hf_name, hf_shape in hf_shapes.items():
      meta_name, dim = names[hf_name]
      shapes = [self.piece_shape(i, meta_name) for i in range(len(files))]
      for file, shape in zip(files[1:], shapes[1:]):
        if len(shape) != len(shapes[0]) or any(
          a != b for axis, (a, b) in enumerate(zip(shape, shapes[0])) if axis != dim
        ):
          raise MetaCheckpointError(f"{meta_name} has shape {shape} in {file} but {shapes[0]} in {files[0]}")
      if len(shapes[0]) != len(hf_shape):
        raise MetaCheckpointError(
          f"{meta_name} has shape {shapes[0]} in {files[0]}, but params.json implies {hf_shape}"
        )
      merged = list(shapes[0])
      if dim is not None:
        merged[dim] = sum(shape[dim] for shape in shapes)
      if tuple(merged) != hf_shape:
        raise MetaCheckpointError(
          f"{meta_name} merges to {tuple(merged)} from {len(files)} shard(s), but params.json implies {hf_shape}"
        )
      if meta_name.endswith(("wq.weight", "wk.weight")) and any(shape[0] % cfg.head_dim for shape in shapes):
        raise MetaCheckpointError(
          f"{meta_name} splits into {[s[0] for s in shapes]} rows, not whole heads of {cfg.head_dim} rows"
        )

  def piece_shape(self, index: int, name: str) -> tuple[int, ...]:
    if name not in self.shards[index]:
      raise MetaCheckpointError(f"{os.path.basename(self.paths[index])} has no tensor {name!r}")
    return tuple(self.shards[index][name].shape)

  def copy_into(self, hf_views: Iterable[tuple[str, np.ndarray]]) -> None:
    """Fills each (HF name, HF-layout [out, in] array) with the merged tensor, copied piece by piece from the mapped
    shards (q/k rows permuted to half rotation). A piece holding NaN or infinity is refused: a damaged shard, or a
    model saved after it diverged, which every later step (training, export) would refuse anyway."""
    cfg, names = self.cfg, meta_names(self.cfg)
    for hf_name, hf in hf_views:
      meta_name, dim = names[hf_name]
      offset = 0
      for path, shard in list(zip(self.paths, self.shards))[: 1 if dim is None else None]:
        piece = _torch_numpy(shard[meta_name])
        _check_finite(piece, meta_name, path)
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


def _check_finite(piece: np.ndarray, name: str, path: str) -> None:
  for start, stop in row_blocks(piece.shape):  # blocks: a bool mask of the whole piece would be a large temporary
    if not np.isfinite(piece[start:stop]).all():
      raise MetaCheckpointError(
        f"{name} in {path} holds NaN or infinity (rows {start}-{stop - 1}): the shard is damaged, or the model was "
        "saved after it diverged"
      )


def _release_pages(tensor: Any) -> None:
  """Hands a memory-mapped tensor's pages back to the kernel once copied (Linux ≥ 5.4, best effort), so that the
  mapped shards do not add up to a second copy of the model in this process's resident memory (BENCHMARKS.md,
  "Figures behind the code"). MADV_PAGEOUT rather than MADV_DONTNEED: it never discards data, mapped or not."""
  if sys.platform != "linux" or tensor.numel() == 0:
    return
  import ctypes
  import mmap

  start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
  end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
  ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT


def from_meta(meta_dir: str, out_dir: str) -> tuple[ModelConfig, str]:
  """Converts Meta's LLaMA 2 or Llama 3.x download into a new llama_jax checkpoint directory.

  The download is params.json, the model-parallel shards consolidated.NN.pth and tokenizer.model. The shards are
  memory-mapped and merged piece by piece into the params, the rows of wq and wk permuted from Meta's interleaved
  RoPE pairs to the half-split layout llama_jax and HF use. A sentencepiece tokenizer.model is copied along; Llama
  3's tiktoken table is left out, since llama_jax cannot read it. Everything is checked before anything is written;
  a failure leaves no output directory.

  Args:
    meta_dir: the directory of Meta's download.
    out_dir: the new checkpoint directory; it must not exist or be empty.

  Returns:
    A tuple: the model config, and a line saying what became of the tokenizer.

  Raises:
    MetaCheckpointError: params.json or a shard is missing, unreadable or not the model params.json describes, a
      piece holds NaN or infinity, or torch, which reads the shards, is not installed.
    ConvertError: `out_dir` is not empty.
  """
  check_new_output(out_dir)
  shards = MetaShards(meta_dir, lambda cfg: {t.name: t.shape for t in hf_tensor_plan(cfg)})
  cfg, params = shards.cfg, empty_params(shards.cfg)
  tokenizer, tokenizer_line = _meta_tokenizer(meta_dir)
  shards.copy_into((t.name, hf_view(leaf_at(params, t.path), t)) for t in hf_tensor_plan(cfg))
  del shards  # unmaps the .pth files
  with new_output_dir(out_dir) as scratch:
    checkpoint_params.save_params_dir(scratch, cfg, params, tokenizer_path=tokenizer)
  return cfg, tokenizer_line


def _meta_tokenizer(meta_dir: str) -> tuple[str | None, str]:
  """The download's tokenizer.model to copy, if it is one llama_jax reads, and a line saying what became of it.

  LLaMA 2 ships a sentencepiece model; Llama 3 ships a tiktoken BPE table (lines of "<base64 token> <rank>"), which
  sentencepiece cannot read: it is left out rather than copied into a checkpoint every command would then fail to
  load."""
  path = tokenizer_in(meta_dir)
  if path is None:
    return None, f"no {paths.TOKENIZER_FILE} in {meta_dir}: the checkpoint has no tokenizer"
  with open(path, "rb") as f:
    first_line = f.readline(4096).rstrip(b"\n")
  if _TIKTOKEN_LINE.fullmatch(first_line):
    return None, (
      f"{path} is a tiktoken BPE table (Llama 3), which llama_jax does not read: not copied; the checkpoint has no "
      "tokenizer (the HF release's tokenizer.json is the same vocabulary)"
    )
  return path, f"tokenizer: {paths.TOKENIZER_FILE} copied"
