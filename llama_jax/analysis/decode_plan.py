"""Ahead-of-time plan of decoding on a mesh: compile the Sampler's own decode loop (and prefill) for abstract
weights and an abstract KV cache, allocate nothing, report per-device memory, collectives per generated token, and
the largest batch each accelerator holds.

    python -m llama_jax.plan --decode --config configs/llama2_7b.py --devices 1 --batch 8 --max_len 4096
        [--dtype bfloat16] [--quantize int8] [--mesh data=1,tensor=-1] [--prefill_len P] [--json F]
    python -m llama_jax.plan --decode --config configs/llama2_70b.py --topology v5e-16 --batch 8 --max_len 4096

What is compiled is what ``sampler.Sampler`` runs: `sampler.decode` (the while_loop, state donated) and
`sampler.prefill` (the prompt into the cache), jitted the same way, traced under the decode mesh and rules of
``placement``. Weights
are the decode layout (unstacked layers, kv heads repeated to fill the tensor axis, int8 as asked) with their decode
shardings; the cache holds `batch` rows (padded to a multiple of the data axis, as the Sampler pads) × `max_len` slots.

Weight and cache bytes come from the shardings (exact). Temporaries come from the compiler's memory analysis; the
largest batch is extrapolated from a second compile at 8 more rows per device (rows + 8 × data: the TPU compiler
pads the batch to tiles of 8 rows, so a one-row step would measure padding; everything that grows with the batch,
the cache exactly, temporaries and token buffers as the two compiles differ). The TPU compiler refuses a program
that does not fit the chip: a first compile refused is an error; where a second is refused, the growth per row is
bounded from the first alone (every byte but the weights counted per row: conservative).

On the CPU compiler (``--devices``), XLA:CPU has no bfloat16 or int8 matmul: it widens every narrower weight to a
float32 copy, hoisted out of the loop (twice the bf16 model, alive for the whole loop). GPU and TPU compilers
multiply bf16 directly, so those copies are reported but left out of the peak; other temporaries stay an estimate
(TPU: ``--topology``, the real compiler).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llama_jax.analysis import hlo
from llama_jax.analysis.memory import (
  GIB,
  PlanError,
  PlanHeader,
  device_bytes,
  format_bytes,
  hbm_targets,
  model_config_for_plan,
  report_unit,
)
from llama_jax.core.accelerators import HBM_GIB
from llama_jax.core.run_config import RunConfig, run_config_from
from llama_jax.inference import placement, sampler
from llama_jax.inference.sampling import SamplingConfig
from llama_jax.model import sharding
from llama_jax.model.llama import EXPERT_AXES, KVCache, Llama

# LLaMA's eos and pad ids: their values do not change the compiled program (one stop id, a constant pad).
EOS_ID, PAD_ID = 2, 0
# Rows per device added for the second compile (see the module docstring).
ROWS_PER_TILE = 8


@dataclasses.dataclass
class ProgramMemory:
  """Per-device bytes of one compiled program (XLA's memory analysis) for `rows` batch rows."""

  rows: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written in place of the donated state / cache
  temp_bytes: int  # as compiled
  widened_weight_bytes: int  # of temp_bytes: XLA:CPU's float32 copies of narrower weights (0 on other compilers)

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not written in place + temporaries, without XLA:CPU's widened weight copies."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes - self.widened_weight_bytes


@dataclasses.dataclass
class DecodePlan(PlanHeader):
  """Per-device bytes of decoding `batch` rows × `max_len` slots, and what produced them (collectives and kernels
  per generated token: the decode loop's body, counted once)."""

  param_dtype: str
  dtype: str  # compute and KV cache
  quantize: str
  n_kv_heads: int  # as decoded (repeated to fill the tensor axis)
  kv_repeats: int
  batch: int
  rows: int  # batch padded to a multiple of the data axis
  max_len: int  # cache slots per row (prompt bucket + new tokens)
  prefill_len: int  # prompt bucket of the compiled prefill (0: not compiled)
  prefill_chunk: int  # tokens per model call of the prefill (0: the whole bucket in one)
  weight_bytes: int  # from the shardings
  expert_weight_bytes: int  # of weight_bytes: a mixture's expert weights (0 for a dense model)
  cache_bytes: int  # from the shardings: k, v of every layer, slot positions, index
  state_bytes: int  # the whole decode state: cache + per-row tokens, positions, flags, rng
  decode: ProgramMemory
  # The same programs for 8 more rows per device (rows + 8 × data): how memory grows per row. None where that does
  # not compile (the TPU compiler refuses a program that does not fit); see `_lines`.
  decode_more_rows: ProgramMemory | None
  prefill: ProgramMemory | None
  prefill_more_rows: ProgramMemory | None

  @property
  def peak_bytes(self) -> int:
    """The larger of the decode loop's and the prefill's peaks: both programs run on the same weights and cache."""
    return max(p.peak_bytes for p in (self.decode, self.prefill) if p is not None)

  def _lines(self) -> list[tuple[float, float]]:
    """(bytes at zero rows, bytes per row) of each compiled program: linear through its two compiles. Where the
    second did not compile, an upper bound for batches from `rows` on: every byte but the weights grows per row."""
    out = []
    for one, more in ((self.decode, self.decode_more_rows), (self.prefill, self.prefill_more_rows)):
      if one is not None and more is None:
        out.append((self.weight_bytes, (one.peak_bytes - self.weight_bytes) / one.rows))
      elif one is not None:
        per_row = (more.peak_bytes - one.peak_bytes) / (more.rows - one.rows)
        out.append((one.peak_bytes - one.rows * per_row, per_row))
    return out

  def bytes_per_row(self) -> float:
    """Peak bytes per added batch row of the program that grows fastest."""
    return max(per_row for _, per_row in self._lines())

  def max_batch(self, hbm_gib: float) -> int:
    """The largest batch (a multiple of the data axis) whose estimated peaks all fit in `hbm_gib`: 0 if none, -1
    if memory does not grow with the batch (no bound from memory)."""
    step, budget = self.mesh["data"], hbm_gib * GIB
    largest = math.inf
    for fixed, per_row in self._lines():
      if per_row <= 0:
        largest = largest if fixed <= budget else 0
      else:
        largest = min(largest, step * math.floor((budget - fixed) / (per_row * step)))
    return -1 if largest == math.inf else max(int(largest), 0)

  def fits(self, hbm_gib: float) -> bool:
    return self.peak_bytes <= hbm_gib * GIB


def check_request(cfg, batch: int, max_len: int, prefill_len: int) -> None:
  if batch < 1:
    raise PlanError(f"--batch must be ≥ 1, got {batch}")
  if not 1 <= max_len <= cfg.max_seq_len:
    raise PlanError(
      f"--max_len must be in [1, {cfg.max_seq_len}] (the model's max_seq_len), got {max_len}; raise "
      f"--config.model.max_seq_len for longer contexts"
    )
  if not 0 <= prefill_len <= max_len:
    raise PlanError(f"--prefill_len must be in [0, --max_len {max_len}] (0: no prefill plan), got {prefill_len}")


def _replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def decode_model(model_cfg, mesh, dtype: str | None = None, quantize: str = "none"):
  """(decode config, abstract params with their decode shardings): what ``Sampler(model_cfg, params, mesh=mesh,
  dtype=dtype, quantize=quantize)`` places."""
  cfg = placement.decode_config(model_cfg, mesh, dtype, quantize)
  if quantize == "int8":
    cfg = cfg.replace(quantize="int8")
  return cfg, placement.decode_targets(cfg, mesh)


def abstract_cache(cfg, mesh, rules, rows: int, length: int) -> KVCache:
  """The per-layer KV cache ``Sampler.empty_cache`` creates, as ShapeDtypeStructs with its shardings."""
  shapes = jax.eval_shape(lambda: KVCache.empty(cfg, rows, length, per_layer=True))
  shardings = sampler.cache_formats(mesh, rules, cfg.n_layers, layout=None)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def abstract_decode_state(cfg, mesh, rules, rows: int, length: int, new_tokens: int) -> sampler.DecodeState:
  """The DecodeState prefill hands the decode loop: the cache in its shardings, the small per-row arrays and the
  rng key replicated (as the sampler's decode state is constrained)."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  return sampler.DecodeState(
    cache=abstract_cache(cfg, mesh, rules, rows, length),
    token=_replicated(mesh, (rows,), jnp.int32),
    position=_replicated(mesh, (rows,), jnp.int32),
    done=_replicated(mesh, (rows,), jnp.bool_),
    rng=_replicated(mesh, key.shape, key.dtype),
    step=_replicated(mesh, (), jnp.int32),
    tokens=_replicated(mesh, (rows, new_tokens), jnp.int32),
  )


_ENTRY_PARAMETER = re.compile(r"^\s*%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* parameter\(")
_ENTRY_WIDENING = re.compile(r"^\s*%[\w.\-]+ = f32\[([\d,]*)\]\S* (?:fusion|convert)\(%([\w.\-]+)\)")


def widened_weight_bytes(hlo_text: str) -> int:
  """Bytes of float32 copies of whole narrower entry parameters made in the entry computation: how XLA:CPU, which
  has no bf16 / int8 matmul, runs bf16 or int8 weights. In the decode loop they are hoisted before the loop and
  carried through it, so all are alive at its peak; in the prefill (no loop) that all are alive at the peak is an
  assumption: the CPU temporaries there exceeded the copies (BENCHMARKS.md, "Figures behind the code")."""
  entry = hlo_text[hlo_text.index("\nENTRY") :].split("\n}", 1)[0].splitlines()
  narrow = {}
  for line in entry:
    if m := _ENTRY_PARAMETER.match(line):
      if m.group(2) in ("bf16", "f16", "s8", "u8"):
        narrow[m.group(1)] = m.group(3)
  total = 0
  for line in entry:
    if (m := _ENTRY_WIDENING.match(line)) and m.group(2) in narrow:
      elements = math.prod(int(d) for d in filter(None, m.group(1).split(",")))
      if elements == math.prod(int(d) for d in filter(None, narrow[m.group(2)].split(","))):
        total += 4 * elements
  return total


def _memory(compiled, rows: int, platform: str) -> ProgramMemory:
  memory = compiled.memory_analysis()
  widened = widened_weight_bytes(compiled.as_text()) if platform == "cpu" else 0
  return ProgramMemory(
    rows=rows,
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    widened_weight_bytes=widened,
  )


class _Programs:
  """The Sampler's own jitted prefill and decode loop (placements and cache layout included) for one mesh, compiled
  for abstract weights and caches of a given number of rows."""

  def __init__(self, cfg, params, mesh, devices, max_len: int, prefill_len: int, prefill_chunk: int = 0):
    self.cfg, self.params, self.mesh, self.devices = cfg, params, mesh, devices
    self.max_len, self.prefill_len, self.prefill_chunk = max_len, prefill_len, prefill_chunk
    self.rules = placement.decode_rules(cfg, mesh)
    self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=False)))
    self.layout = sampler.default_cache_layout(devices[0].platform, cfg.head_dim)

  def _jitted(self, new_tokens: int):
    return sampler.decode_programs(
      self.graphdef,
      self.mesh,
      self.rules,
      sharding.shardings_of(self.params),
      self.cfg.n_layers,
      layout=self.layout,
      sampling=SamplingConfig(),
      max_new_tokens=new_tokens,
      stop_ids=(EOS_ID,),
      pad_id=PAD_ID,
      prefill_chunk=self.prefill_chunk,
    )

  def decode(self, n_rows: int):
    """(compiled decode loop, its abstract state). The new-token buffer is sized max_len, an upper bound (a real call
    holds max_len − prompt bucket)."""
    state = abstract_decode_state(self.cfg, self.mesh, self.rules, n_rows, self.max_len, self.max_len)
    with sharding.activate(self.mesh, self.rules):
      compiled = self._jitted(self.max_len)[1].lower(self.params, state, _replicated(self.mesh, (), jnp.int32))
      return compiled.compile(), state

  def prefill(self, n_rows: int):
    mesh, rules = self.mesh, self.rules
    batch_spec = sharding.logical_to_spec(("activation_batch",), rules)
    prompts = jax.ShapeDtypeStruct(
      (n_rows, self.prefill_len), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(*batch_spec, None))
    )
    lengths = jax.ShapeDtypeStruct((n_rows,), jnp.int32, sharding=NamedSharding(mesh, batch_spec))
    cache = abstract_cache(self.cfg, mesh, rules, n_rows, self.max_len)
    seed = _replicated(mesh, (), jnp.uint32)
    with sharding.activate(mesh, rules):
      prefill_fn = self._jitted(max(self.max_len - self.prefill_len, 1))[0]
      return prefill_fn.lower(self.params, prompts, lengths, cache, seed).compile()

  def compile_or_none(self, name: str, compile_fn, n_rows: int, required: bool):
    """The compiled program; where the TPU compiler finds it does not fit: an error if `required`, else None."""
    try:
      return compile_fn(n_rows)
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      if not required:
        return None
      raise PlanError(
        f"the {name} of {n_rows} rows × {self.max_len} slots does not fit one {self.devices[0].device_kind} ("
        f"{str(e).splitlines()[0].split(': ', 1)[-1]}); lower --batch, --max_len or --prefill_len, or add devices"
      ) from None


def plan(
  run_config: RunConfig,
  devices,
  batch: int,
  max_len: int,
  *,
  dtype: str | None = None,
  quantize: str = "none",
  mesh_spec: str | None = None,
  prefill_len: int | None = None,
  prefill_chunk: int = 0,
) -> DecodePlan:
  """Compiles the Sampler's decode loop (and prefill of a `prefill_len` prompt, default `max_len`: the longest the
  cache takes) for `batch` rows of `max_len` slots over `devices`, each at `batch` and at 8 more rows per device.
  Its length is the DecodePlan it fills, field by field (the compiles are `_Programs`')."""
  start = time.perf_counter()
  run_config = run_config_from(run_config)
  devices = list(devices)
  platform = devices[0].platform
  prefill_len = max_len if prefill_len is None else prefill_len
  check_request(run_config.model, batch, max_len, prefill_len)
  mesh = placement.decode_mesh(mesh_spec, devices)
  stored = model_config_for_plan(run_config.model, platform, max_len)
  cfg, params = decode_model(stored, mesh, dtype, quantize)
  if prefill_chunk < 0:
    raise PlanError(f"--prefill_chunk must be ≥ 0 (0: the whole prompt in one call), got {prefill_chunk}")
  programs = _Programs(cfg, params, mesh, devices, max_len, prefill_len, prefill_chunk)
  rows = placement.padded_rows(batch, mesh)
  more_rows = rows + ROWS_PER_TILE * mesh.shape["data"]
  compile_start = time.perf_counter()
  compiled, state = programs.compile_or_none("decode loop", programs.decode, rows, True)
  program = hlo.summarize(compiled.as_text())
  more = programs.compile_or_none("decode loop", programs.decode, more_rows, False)
  memory = dict(
    decode=_memory(compiled, rows, platform), decode_more_rows=more and _memory(more[0], more_rows, platform)
  )
  memory.update(prefill=None, prefill_more_rows=None)
  if prefill_len:
    memory["prefill"] = _memory(programs.compile_or_none("prefill", programs.prefill, rows, True), rows, platform)
    more = programs.compile_or_none("prefill", programs.prefill, more_rows, False)
    memory["prefill_more_rows"] = more and _memory(more, more_rows, platform)
  compile_seconds = time.perf_counter() - compile_start
  return DecodePlan(
    **PlanHeader.fields(mesh, devices, cfg.num_params(), program, compile_seconds, seconds=time.perf_counter() - start),
    param_dtype=cfg.param_dtype,
    dtype=cfg.dtype,
    quantize=cfg.quantize,
    n_kv_heads=cfg.n_kv_heads,
    kv_repeats=cfg.n_kv_heads // stored.n_kv_heads,
    batch=batch,
    rows=rows,
    max_len=max_len,
    prefill_len=prefill_len,
    prefill_chunk=prefill_chunk,
    weight_bytes=device_bytes(params),
    expert_weight_bytes=device_bytes(expert_weights(params) if cfg.moe.enabled else []),
    cache_bytes=device_bytes(state.cache),
    state_bytes=device_bytes(state),
    **memory,
  )


def expert_weights(params: Any) -> list:
  """The expert weights (every layer's mlp w_gate, w_up, w_down) among a mixture of experts' params."""
  return [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    if sharding.path_name(path).split("/")[-2:] in (["mlp", name] for name in EXPERT_AXES)
  ]


def report(p: DecodePlan, hbm_gib: float | None = None) -> str:
  """The plan as the command prints it: one line per figure, in the order they are read (long as the report is)."""
  weights = f"int8 + float32 scales (from {p.param_dtype})" if p.quantize == "int8" else p.param_dtype
  repeats = f", kv heads repeated {p.kv_repeats}× to {p.n_kv_heads}" if p.kv_repeats > 1 else ""
  unit, scale = report_unit(p.peak_bytes)
  lines = [
    f"model     {p.n_params:,} parameters, weights {weights}, compute and KV cache {p.dtype}{repeats}",
    p.mesh_line(),
    f"decode    batch {p.batch}"
    + (f" (padded to {p.rows} rows)" if p.rows != p.batch else "")
    + f" × {p.max_len} cache slots; "
    + (f"prefill of a {p.prefill_len}-token prompt bucket" if p.prefill_len else "prefill not planned")
    + (f" in chunks of {p.prefill_chunk}" if p.prefill_len and p.prefill_chunk else ""),
    f"per device ({unit}):",
  ]

  def row(label: str, n: int, note: str = "") -> None:
    lines.append(f"  {label:<26} {n / scale:9.3f}" + (f"   ({note})" if note else ""))

  row("weights", p.weight_bytes, "from the shardings")
  if p.expert_weight_bytes:
    row("  of which experts", p.expert_weight_bytes, "split by the mesh's expert and tensor axes")
  per_row = format_bytes(p.cache_bytes / max(p.rows // p.mesh["data"], 1))
  row("KV cache", p.cache_bytes, f"from the shardings; {per_row} per row on this device")
  for name, program in (("decode loop", p.decode), ("prefill", p.prefill)):
    if program is None:
      continue
    row(f"{name} temporaries", program.temp_bytes, "compiled")
    if program.widened_weight_bytes:
      row("  of which f32 weight copies", program.widened_weight_bytes, "XLA:CPU only, left out of the peak")
    row(f"{name} peak", program.peak_bytes, "arguments + outputs not donated + temporaries")
  row("peak", p.peak_bytes, "the larger program's")
  lines.append(
    "collectives per generated token and device (the decode loop's body: its trip count depends on the data, so it "
    "is counted once; executions, size of the arrays they produce):"
  )
  lines += [*p.collective_lines(executed_only=True), *p.kernel_lines("token")]
  per_row = p.bytes_per_row()
  more_rows = p.rows + ROWS_PER_TILE * p.mesh["data"]
  refused = p.decode_more_rows is None or (p.prefill is not None and p.prefill_more_rows is None)
  lines.append(
    f"fit at {p.max_len} slots, largest batch estimated from compiles at {p.rows} and {more_rows} "
    f"rows ({format_bytes(per_row)} per row and device"
    + (
      f"; {more_rows} rows did not fit one {p.device_kind}: bound from {p.rows} rows, all but the weights per row"
      if refused
      else ""
    )
    + "):"
  )
  for name, gib in hbm_targets(hbm_gib).items():
    verdict = "fits" if p.fits(gib) else "does not fit"
    largest = p.max_batch(gib)
    most = "no memory bound" if largest < 0 else f"largest batch {largest}"
    lines.append(
      f"  {name:<14} {gib:>6g} GiB: batch {p.batch} {verdict} ({gib - p.peak_bytes / GIB:+.2f} GiB to spare); {most}"
    )
  lines.append(p.timing_line("GPU and TPU compilers"))
  return "\n".join(lines)


def to_json(p: DecodePlan) -> dict[str, Any]:
  out = dataclasses.asdict(p)
  out["peak_bytes"] = p.peak_bytes
  out["max_batch"] = {name: p.max_batch(gib) for name, gib in HBM_GIB.items()}
  for name in ("decode", "decode_more_rows", "prefill", "prefill_more_rows"):
    program = getattr(p, name)
    if program is not None:
      out[name]["peak_bytes"] = program.peak_bytes
  return out
