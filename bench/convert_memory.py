"""Peak host memory of `python -m llama_jax.convert` in each direction, against the model's bytes.

    python bench/convert_memory.py                      # dim 1024, 24 layers, vocab 32000: 1.50 GB of float32
    python bench/convert_memory.py --dim 256 --n_layers 4 --vocab_size 32000 --json out.json

A random float32 model is saved as a llama_jax checkpoint, then converted --to_hf, back --from_hf, and --from_meta
from two model-parallel consolidated.NN.pth shards (written from the HF files; needs torch). Each conversion runs in a
fresh child process that first imports everything and starts JAX (and torch, for --from_meta); then its resident-set
high-water mark is reset (Linux: /proc/self/clear_refs) and the conversion's peak is VmHWM minus the resident size at
that moment, i.e. the memory the conversion itself added, file-backed pages of mapped files included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion runs on the host; never probe for accelerators

DIRECTIONS = ("to_hf", "from_hf", "from_meta")


def _status_bytes(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def child(direction: str, source: str, out: str, result_path: str) -> None:
  """Runs one conversion and writes {"peak_bytes", "baseline_bytes", "seconds"} to `result_path`."""
  import jax

  from llama_jax import interop

  if direction == "from_meta":
    import torch  # noqa: F401
  convert = getattr(interop, direction)  # imported now, before the baseline
  jax.devices()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident size
  baseline = _status_bytes("VmRSS")
  start = time.perf_counter()
  convert(source, out)
  seconds = time.perf_counter() - start
  result = {"peak_bytes": _status_bytes("VmHWM") - baseline, "baseline_bytes": baseline, "seconds": seconds}
  with open(result_path, "w") as f:
    json.dump(result, f)


def _run_children(runs: list[tuple[str, str, str]], workdir: str, parallel: bool) -> dict[str, dict]:
  """{direction: child's result} of (direction, source, out) runs, one process each (at once with `parallel`: each
  measures its own memory, only the times share the CPUs)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  processes = {}
  for direction, source, out in runs:
    result = os.path.join(workdir, f"{direction}.json")
    command = [sys.executable, os.path.abspath(__file__), "--child", direction, source, out, result]
    processes[direction] = subprocess.Popen(command, env=env)
    if not parallel:
      processes[direction].wait()
  results = {}
  for direction, process in processes.items():
    if process.wait():
      raise RuntimeError(f"the {direction} child failed with exit status {process.returncode}")
    with open(os.path.join(workdir, f"{direction}.json")) as f:
      results[direction] = json.load(f)
  return results


def write_meta_dir(hf_dir: str, meta_dir: str, cfg, n_shards: int = 2) -> None:
  """Meta's layout from an HF directory: q/k rows back to interleaved pairs, tensors split along Meta's dims."""
  import torch
  from safetensors import safe_open

  from llama_jax.interop import meta as meta_checkpoint

  names = meta_checkpoint.meta_names(cfg)  # HF name → (Meta name, split dim)

  shards = [{} for _ in range(n_shards)]
  for file in sorted(os.listdir(hf_dir)):
    if not file.endswith(".safetensors"):
      continue
    with safe_open(os.path.join(hf_dir, file), framework="numpy") as f:
      for hf_name in f.keys():
        w = f.get_tensor(hf_name)
        name, dim = names[hf_name]
        if name.endswith(("wq.weight", "wk.weight")):
          heads = w.shape[0] // cfg.head_dim
          w = w.reshape(heads, 2, cfg.head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
        pieces = [w] * n_shards if dim is None else np.split(w, n_shards, axis=dim)
        for shard, piece in zip(shards, pieces):
          shard[name] = torch.from_numpy(np.ascontiguousarray(piece))
  os.makedirs(meta_dir)
  for i, shard in enumerate(shards):
    torch.save(shard, os.path.join(meta_dir, f"consolidated.{i:02d}.pth"))
  params = dict(
    dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, multiple_of=cfg.multiple_of, norm_eps=cfg.norm_eps
  )
  with open(os.path.join(meta_dir, "params.json"), "w") as f:
    json.dump({**params, "vocab_size": -1}, f)


def measure(
  dim: int, n_layers: int, vocab_size: int, workdir: str, directions=DIRECTIONS, parallel: bool = False
) -> dict:
  """{"model_bytes", direction: {"peak_bytes", "baseline_bytes", "seconds", "ratio"}} for a random float32 model."""
  import jax

  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.core.model_config import ModelConfig
  from llama_jax.interop import hf as convert
  from llama_jax.model import sharding
  from llama_jax.model.llama import Llama

  cfg = ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=max(2, dim // 64), multiple_of=256)
  _, target = sharding.abstract_params(Llama, cfg)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: 0.02 * rng.standard_normal(a.shape, dtype=np.float32), target)
  model_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  assert model_bytes == 4 * cfg.num_params()
  checkpoint_params.save_params_dir(os.path.join(workdir, "ckpt"), cfg, params)
  convert.write_hf_dir(os.path.join(workdir, "hf"), cfg, params)
  if "from_meta" in directions:
    write_meta_dir(os.path.join(workdir, "hf"), os.path.join(workdir, "meta"), cfg)
  del params
  report = {"model_bytes": model_bytes, "params": cfg.num_params(), "config": dict(dim=dim, n_layers=n_layers)}
  report["config"]["vocab_size"] = vocab_size
  sources = {
    "to_hf": ("ckpt", "hf_from_ckpt"),
    "from_hf": ("hf", "ckpt_from_hf"),
    "from_meta": ("meta", "ckpt_from_meta"),
  }
  runs = [(d, *(os.path.join(workdir, name) for name in sources[d])) for d in directions]
  for direction, result in _run_children(runs, workdir, parallel).items():
    result["ratio"] = result["peak_bytes"] / model_bytes
    report[direction] = result
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dim", type=int, default=1024)
  parser.add_argument("--n_layers", type=int, default=24)
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument("--directions", default=",".join(DIRECTIONS), help=f"comma-separated, of {DIRECTIONS}")
  parser.add_argument("--workdir", help="where the model copies go (default: a new temporary directory)")
  parser.add_argument("--json", help="also write the figures to this file")
  parser.add_argument("--parallel", action="store_true", help="run the conversions at once (faster; times share CPUs)")
  parser.add_argument("--child", nargs=4, metavar=("DIRECTION", "SOURCE", "OUT", "RESULT"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(*args.child)
    return
  with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
    directions = tuple(args.directions.split(","))
    report = measure(args.dim, args.n_layers, args.vocab_size, workdir, directions, args.parallel)
  report["machine"] = platform.processor() or platform.machine()
  model_bytes = report["model_bytes"]
  print(f"model: {report['params']:,} float32 parameters = {model_bytes:,} bytes ({report['config']})")
  for direction in DIRECTIONS:
    if direction in report:
      r = report[direction]
      print(
        f"{direction}: peak +{r['peak_bytes']:,} bytes = {r['ratio']:.2f}× the model "
        f"(baseline {r['baseline_bytes'] / 2**20:.0f} MiB after imports, {r['seconds']:.1f} s)"
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
