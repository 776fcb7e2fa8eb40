"""Attention forward + backward on CPU by sequence length: the one-device kernels ("xla": whole [T, T] scores;
"chunked": by query chunks) and context parallelism (all-gather, ring and zigzag ring) over 2 and 4 simulated devices.

    python bench/attention.py --json bench_attention.json          # T = 1,024, 4,096, 16,384 (a quiet machine)
    python bench/attention.py --lengths 256 --repeats 1             # smoke run (seconds)
    JAX_PLATFORMS=cuda python bench/attention.py --dtype bfloat16 --lengths 4096,16384,32768 --max_gib 100
                                                                     # on a GPU: xla, chunked and cuDNN, one device

One sequence, 8 query heads sharing 4 kv heads of 64 (GQA), float32, packed as one document. Time is the median
wall time of jitted grad(sum(attention · w)) over q, k, v; memory is XLA's temporaries per device of that compiled
program (the compiler's plan; nothing is run to measure it). The simulated devices share this machine's cores, so
the context rows show what splitting the sequence costs in exchanges and bookkeeping on the same silicon, not the
speed-up real devices would give, and the zigzag row against the ring's shows the masked work it skips (the zigzag
row includes moving q, k, v into its layout and the output back, which a model does once per step, not per layer);
their memory column is what each device would hold. A row whose temporaries
exceed --max_gib is compiled (memory reported) but not run. On a GPU the cuDNN fused kernel (what "auto" picks
there) gets a row, and context rows need as many devices as they split over. With --dtype other than float32, each
row also reports its output's largest difference from the chunked kernel's in float32 on the same (rounded) inputs.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import cpu_name, median_seconds  # noqa: E402

from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES  # noqa: E402
from llama_jax.model import attention as attention_lib  # noqa: E402
from llama_jax.model import context as context_lib  # noqa: E402
from llama_jax.model import sharding  # noqa: E402

N_HEADS, N_KV_HEADS, HEAD_DIM = 8, 4, 64
AXES = {
  "q": ("activation_batch", "activation_length", "activation_heads", None),
  "kv": ("activation_batch", "activation_length", "activation_kv_heads", None),
}


def inputs(length: int, dtype=np.float32):
  rs = np.random.RandomState(0)
  q = rs.normal(size=(1, length, N_HEADS, HEAD_DIM))
  k, v = (rs.normal(size=(1, length, N_KV_HEADS, HEAD_DIM)) for _ in range(2))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, rs.normal(size=q.shape)))


def measure(kernel, length: int, devices: int, repeats: int, max_gib: float, dtype, reference) -> dict:
  """Compiles and (memory permitting) times grad of sum(kernel(q, k, v) · w) on a context mesh of `devices`; with
  `reference` (float32 outputs), the largest difference of this kernel's output from it."""
  q, k, v, w = inputs(length, dtype)
  grad = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(kernel(q, k, v) * w), argnums=(0, 1, 2)))
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, context=devices, tensor=1), jax.devices()[:devices])
  with sharding.activate(mesh, DEFAULT_LOGICAL_AXIS_RULES):
    placed = [
      jax.device_put(x, jax.NamedSharding(mesh, sharding.logical_to_spec(AXES[axes], DEFAULT_LOGICAL_AXIS_RULES)))
      for x, axes in zip((q, k, v, w), ("q", "kv", "kv", "q"))
    ]
    compiled = grad.lower(*placed).compile()
  temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  temp_gib = temp_bytes / 2**30
  row = {"length": length, "devices": devices, "temp_bytes_per_device": temp_bytes, "temp_gib": round(temp_gib, 3)}
  if temp_gib > max_gib:
    return row | {"seconds": None, "skipped": f"temporaries {temp_gib:.1f} GiB > --max_gib {max_gib}"}
  run = lambda: jax.block_until_ready(compiled(*placed))  # noqa: E731
  row |= {"seconds": round(median_seconds(run, repeats, warmup=1), 4)}
  if reference is not None:
    with sharding.activate(mesh, DEFAULT_LOGICAL_AXIS_RULES):
      out = jax.jit(kernel)(*placed[:3])
    row["max_abs_error"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)))
  return row


def zigzag(q, k, v):
  """Zigzag context attention on natural-layout inputs: into the layout, attended, the output back."""
  to = lambda x: context_lib.to_zigzag(x, ("activation_batch", "activation_length", None, None))  # noqa: E731
  out = context_lib.context_attention(to(q), to(k), to(v), strategy="zigzag")
  return context_lib.from_zigzag(out, ("activation_batch", "activation_length", None, None))


def reference_output(length: int, dtype) -> jax.Array:
  """The chunked kernel's output (tested equal to the whole-matrix one; memory ∝ T · chunk) computed in float32 from
  the same `dtype`-rounded inputs: the difference is the kernel's arithmetic, not the inputs' rounding."""
  q, k, v = (x.astype(jnp.float32) for x in inputs(length, dtype)[:3])
  return jax.jit(attention_lib.chunked_attention)(q, k, v)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (after one warm-up)")
  parser.add_argument("--max_gib", type=float, default=6.0, help="run only rows whose temporaries fit this")
  parser.add_argument("--dtype", default="float32", help="of q, k, v: float32, or bfloat16 (cuDNN needs half)")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  kernels = {
    "xla": (lambda q, k, v: attention_lib.xla_attention(q, k, v), (1,)),
    "chunked": (lambda q, k, v: attention_lib.chunked_attention(q, k, v), (1,)),
    "context all_gather": (lambda q, k, v: context_lib.context_attention(q, k, v, strategy="all_gather"), (2, 4)),
    "context ring": (lambda q, k, v: context_lib.context_attention(q, k, v, strategy="ring"), (2, 4)),
    "context zigzag": (zigzag, (2, 4)),
  }
  if jax.default_backend() == "gpu":
    kernels["cudnn"] = (lambda q, k, v: attention_lib.attention(q, k, v, implementation="cudnn"), (1,))
  rows = []
  for length in (int(x) for x in args.lengths.split(",")):
    reference = reference_output(length, dtype) if dtype != jnp.float32 else None
    for name, (kernel, device_counts) in kernels.items():
      for devices in (n for n in device_counts if n <= len(jax.devices())):
        row = {"kernel": name, **measure(kernel, length, devices, args.repeats, args.max_gib, dtype, reference)}
        rows.append(row)
        print(json.dumps(row), flush=True)
  result = {
    "cpu": cpu_name(),
    "cores": os.cpu_count(),
    "device": jax.devices()[0].device_kind,
    "dtype": args.dtype,
    "jax": jax.__version__,
    "rows": rows,
  }
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
