"""safetensors files read and written a block of rows at a time, so that converting a model never holds a second copy
of a tensor: the only temporaries are row blocks of about ``CHUNK_BYTES``.

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{...}}, then the raw bytes. Plain reads rather than a memory map: a mapped file's pages would count towards the
process's memory until it is closed. Large models are written as several files plus ``INDEX_FILE`` (name → file), as
transformers writes them.

This module knows the file format only; which tensors a Llama has and how they map to params is convert.py's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import ml_dtypes
import numpy as np

from llama_jax.core.errors import LlamaJaxError

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F32": np.dtype("float32"), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("float16")}
_DTYPE_NAMES = {dtype.name: name for name, dtype in DTYPES.items()}
# Tensors are moved in row blocks of about this size: the only temporaries a conversion allocates besides the model.
CHUNK_BYTES = 8 * 2**20


class SafetensorsError(LlamaJaxError, ValueError):
  """A safetensors file cannot be read; the message names the file and the tensor."""


class TensorSpec(Protocol):
  """What the writer needs to know of a tensor (convert's HFTensor is one)."""

  @property
  def name(self) -> str: ...

  @property
  def shape(self) -> tuple[int, ...]: ...


def row_blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
  """[start, stop) blocks of the rows of a tensor of `shape`, each about CHUNK_BYTES in float32."""
  rows = shape[0]
  step = max(1, CHUNK_BYTES // (4 * math.prod(shape[1:])))
  for start in range(0, rows, step):
    yield start, min(rows, start + step)


class Entry(NamedTuple):
  path: str
  offset: int  # of the first byte, from the start of the file
  dtype: str  # safetensors' name: F32, BF16 ...
  shape: tuple[int, ...]


def read_entries(path: str) -> dict[str, Entry]:
  """The tensors of one file, from its header alone, checked to be well-formed and to lie within the file: a damaged
  or truncated file is refused here, by name, rather than read as garbage later."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      prefix = f.read(8)
      header_len = int.from_bytes(prefix, "little")
      if len(prefix) < 8 or not 0 < header_len <= size - 8:
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file (truncated?)")
      header = json.loads(f.read(header_len))
  except OSError as e:
    raise SafetensorsError(f"cannot read {path}: {e.strerror or e}") from e
  except ValueError as e:  # json's and utf-8's errors are ValueErrors
    raise SafetensorsError(f"{path} is not a readable safetensors file: {_one_line(e)}") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path} is not a readable safetensors file: its header is not a JSON object")
  entries = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    problem = _entry_problem(name, info, header_len, size)
    if problem:
      raise SafetensorsError(f"{path} is not a readable safetensors file: {problem}")
    begin, _ = info["data_offsets"]
    entries[name] = Entry(path, 8 + header_len + begin, info["dtype"], tuple(info["shape"]))
  return entries


def _entry_problem(name: str, info: Any, header_len: int, size: int) -> str | None:
  """What is wrong with one tensor's header entry, or None."""

  def is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0

  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
    return f"tensor {name!r} has no dtype, shape and data_offsets in the header"
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(dtype, str) or not isinstance(shape, list) or not all(map(is_count, shape)):
    return f"tensor {name!r} has dtype {dtype!r} and shape {shape!r} in the header"
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets)) and offsets[0] <= offsets[1]):
    return f"tensor {name!r} has data_offsets {offsets!r} in the header"
  begin, end = offsets
  # Only the dtypes read here have a known size; a foreign one is refused by name if a conversion needs it.
  if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
    return f"tensor {name!r} of shape {tuple(shape)} and dtype {dtype} has {end - begin} bytes"
  if 8 + header_len + end > size:
    return f"tensor {name!r} ends past the end of the file (truncated?)"
  return None


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split()) or type(e).__name__


class Reader:
  """The tensors of one or more safetensors files, read a block of rows at a time."""

  def __init__(self, paths: list[str]):
    self.entries: dict[str, Entry] = {}
    for path in paths:
      for name, entry in read_entries(path).items():
        if name in self.entries:  # which copy would win is an accident of file order
          raise SafetensorsError(f"tensor {name!r} is stored twice, in {self.entries[name].path} and in {path}")
        self.entries[name] = entry
    self._files: dict[str, Any] = {}

  def dtype(self, name: str) -> np.dtype:
    entry = self.entries[name]
    if entry.dtype not in DTYPES:
      raise SafetensorsError(f"tensor {name!r} in {entry.path} has dtype {entry.dtype}; only {sorted(DTYPES)} are read")
    return DTYPES[entry.dtype]

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    entry, dtype = self.entries[name], self.dtype(name)
    rows = np.empty((stop - start, *entry.shape[1:]), dtype)
    try:
      if entry.path not in self._files:
        self._files[entry.path] = open(entry.path, "rb")  # closed by close()
      f = self._files[entry.path]
      f.seek(entry.offset + start * math.prod(entry.shape[1:]) * dtype.itemsize)
      count = f.readinto(rows.reshape(-1).view(np.uint8))
    except OSError as e:
      raise SafetensorsError(f"cannot read tensor {name!r} from {entry.path}: {e.strerror or e}") from e
    if count != rows.nbytes:  # the header was checked against the file's size, so the file shrank since
      raise SafetensorsError(
        f"{entry.path} ends inside tensor {name!r} (rows {start}-{stop - 1}): the file was truncated while reading"
      )
    return rows

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files.clear()


def write_file(path: str, tensors: Sequence[TensorSpec], dtype: np.dtype, view_of: Callable[[Any], np.ndarray]):
  """One safetensors file of `tensors`, each written a block of rows at a time from its view `view_of(tensor)`."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without "format"
  offset = 0
  for t in tensors:
    nbytes = math.prod(t.shape) * dtype.itemsize
    header[t.name] = {
      "dtype": _DTYPE_NAMES[dtype.name],
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
      view = view_of(t)
      for start, stop in row_blocks(t.shape):
        f.write(np.ascontiguousarray(view[start:stop], dtype=dtype).reshape(-1).view(np.uint8))


def write_sharded(
  out_dir: str,
  tensors: Sequence[TensorSpec],
  dtype: np.dtype,
  view_of: Callable[[Any], np.ndarray],
  max_shard_bytes: int,
) -> None:
  """model.safetensors, or files of at most `max_shard_bytes` with INDEX_FILE, asking `view_of` for each tensor in
  order (each once)."""
  shards, current, size = [], [], 0
  for t in tensors:
    nbytes = math.prod(t.shape) * dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(t)
    size += nbytes
  shards.append(current)
  if len(shards) == 1:
    write_file(os.path.join(out_dir, "model.safetensors"), shards[0], dtype, view_of)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_file(os.path.join(out_dir, name), shard, dtype, view_of)
    weight_map.update({t.name: name for t in shard})
  total = sum(math.prod(t.shape) for shard in shards for t in shard) * dtype.itemsize
  with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
