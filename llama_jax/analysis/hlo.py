"""Reading a compiled program: the collectives a step runs (by kind, with the bytes they move) and its custom kernels.

XLA's optimized HLO text (``compiled.as_text()``) lists computations; the entry computation calls others through
fusions, calls and while loops. A layer scan is a while loop whose body runs once per layer, so an instruction there
counts `trip count` times per step: the trip count is read from the loop condition's bound (``compare(i, constant(N))``,
what ``lax.scan`` lowers to). Counts and bytes are per chip and per step.

Bytes are the size of the array each collective produces on a chip (all-gather: the gathered array; all-reduce and
all-to-all: the buffer; reduce-scatter: the full input that is reduced and scattered), a measure of the traffic, not
the exact bytes on the wire (a ring all-gather of an n-way sharded array sends (n-1)/n of it).

The TPU compiler often overlaps an FSDP weight gather (or a gradient reduce-scatter) with the matmul that uses it: a
"windowed" dot, a loop of collective-permutes each passing one shard around the ring while the previous shard is
multiplied. Those permutes are reported as "all-gather in matmul" / "reduce-scatter in matmul" (their count is
permute steps; their bytes add up to the gathered or scattered array), other permutes as "collective-permute".
"""

from __future__ import annotations

import collections
import dataclasses
import re

COLLECTIVES = (
  "all-gather",
  "all-gather in matmul",
  "reduce-scatter",
  "reduce-scatter in matmul",
  "all-reduce",
  "all-to-all",
  "collective-permute",
)
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s4": 1,
  "u4": 1,
}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")


@dataclasses.dataclass
class Collective:
  count: int = 0  # executions per step
  bytes: int = 0  # summed over those executions, per chip


@dataclasses.dataclass
class ProgramSummary:
  collectives: dict[str, Collective]  # by kind, every kind of COLLECTIVES present (zero counts included)
  kernels: dict[str, int]  # custom-call kernels (e.g. splash_mqa_fwd) → executions per step

  def to_dict(self) -> dict:
    return dict(collectives={k: dataclasses.asdict(v) for k, v in self.collectives.items()}, kernels=self.kernels)


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: an array `bf16[2,64]{1,0}` or a tuple of them."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _DTYPE_BYTES[dtype]
  return total


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """Instructions by computation name, and the entry computation's name. A custom call's backend config may span
  several lines (Mosaic kernels' metadata): those lines are joined to their instruction."""
  computations, entry, current = {}, "", None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif line.rstrip() == "}":
      current = None
    elif current is not None:
      if re.match(r"^\s+(ROOT )?%", line) or not computations[current]:
        computations[current].append(line)
      else:
        computations[current][-1] += line
  return computations, entry


def _constants(lines: list[str]) -> dict[str, int]:
  return {
    m.group(1): int(m.group(2))
    for line in lines
    if (m := re.match(r"^\s*%([\w.\-]+) = [su]32\[\]\S* constant\((\d+)\)", line))
  }


def _tuple_indices(lines: list[str]) -> dict[str, int]:
  """Instruction name → the loop-state index it reads (`get-tuple-element(%param), index=i`)."""
  return {
    m.group(1): int(m.group(2))
    for line in lines
    if (m := re.match(r"^\s*%([\w.\-]+) = .*get-tuple-element\(%[\w.\-]+\), index=(\d+)", line))
  }


def _trip_count(condition: list[str], body: list[str]) -> int:
  """Iterations of a counted loop: `i < N` in the condition, `i + k` in the body (k is 2 where the compiler unrolled
  a windowed matmul's ring twice), from 0. 1 when the loop is not of that form."""
  constants, indices = _constants(condition), _tuple_indices(condition)
  bound = index = None
  for line in condition:
    compare = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT", line)
    if compare and compare.group(1) in indices and compare.group(2) in constants:
      index, bound = indices[compare.group(1)], constants[compare.group(2)]
  if bound is None:
    return 1
  constants, indices = _constants(body), _tuple_indices(body)
  step = 1
  for line in body:
    add = re.search(r"= [su]32\[\]\S* add\(%([\w.\-]+), %([\w.\-]+)\)", line)
    if add and indices.get(add.group(1)) == index and add.group(2) in constants:
      step = max(step, constants[add.group(2)])
  return -(-bound // step)


def _instructions(name: str, lines: list[str]):
  """(instruction, shape, collective kind or None, opcode, rest of the line) of each instruction of computation
  `name`. The TPU compiler writes a reduce-scatter as an all-reduce inside an "all-reduce-scatter" fusion, and the
  rings of windowed matmuls as loops named windowed_dot_general_body_ag (all-gather) or _rs (reduce-scatter); an
  async collective is a -start/-done pair, whose -done's result is the collective's output (the -start's is a tuple
  of operands, outputs and context scalars), so the -done is the one given a kind."""
  fused_reduce_scatter = name.startswith("all-reduce-scatter")
  ring = re.search(r"windowed_dot_general_body_(ag|rs)", name)
  for line in lines:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    instruction, shape, opcode, rest = match.groups()
    kind = opcode.removesuffix("-done")
    if kind not in COLLECTIVES or opcode.endswith("-start"):
      kind = None
    elif fused_reduce_scatter and kind == "all-reduce":
      kind = "reduce-scatter"
    elif ring and kind == "collective-permute":
      kind = "all-gather in matmul" if ring.group(1) == "ag" else "reduce-scatter in matmul"
    yield instruction, shape, kind, opcode, rest


def collective_shapes(hlo: str) -> dict[tuple[str, str], int]:
  """(kind, array shape without layout) → how many collective instructions of that kind produce that shape in the
  program text (instructions, not executions per step): which arrays a program moves, e.g. whether a gradient is
  all-reduced whole."""
  computations, _ = _computations(hlo)
  found: dict[tuple[str, str], int] = collections.Counter()
  for name, lines in computations.items():
    for _, shape, kind, _, _ in _instructions(name, lines):
      if kind is not None:
        found[kind, re.sub(r"\{[^}]*\}", "", shape)] += 1
  return dict(found)


def summarize(hlo: str) -> ProgramSummary:
  """Collectives and custom kernels per step of a compiled program's HLO text.

  Follows the calls from the entry computation: fusions, calls, conditionals' branches and while loops, whose body
  counts once per trip as read from the loop's bound, so that a layer scan's collectives count once per layer. Counts
  and bytes are per chip and per step; the module docstring says what the bytes measure.

  Args:
    hlo: XLA's optimized HLO text, ``compiled.as_text()``.

  Returns:
    A `ProgramSummary`: every kind of `COLLECTIVES` with its executions and bytes, zero counts included, and the TPU
      custom-call kernels by name with their executions.
  """
  computations, entry = _computations(hlo)
  multipliers: dict[str, int] = collections.defaultdict(int)

  def visit(name: str, times: int) -> None:
    multipliers[name] += times
    for line in computations.get(name, ()):
      body = re.search(r"\bbody=%([\w.\-]+)", line)
      condition = re.search(r"\bcondition=%([\w.\-]+)", line)
      if body and condition:
        trips = _trip_count(computations.get(condition.group(1), []), computations.get(body.group(1), []))
        visit(body.group(1), times * trips)
        continue
      for callee in re.findall(r"\b(?:calls|to_apply)=%([\w.\-]+)", line):
        visit(callee, times)
      for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
        for callee in re.findall(r"%([\w.\-]+)", branches):
          visit(callee, times)

  if entry:
    visit(entry, 1)
  collectives = {kind: Collective() for kind in COLLECTIVES}
  kernels: dict[str, int] = collections.Counter()
  for name, lines in computations.items():
    times = multipliers.get(name, 0)
    if not times:
      continue
    for instruction, shape, kind, opcode, rest in _instructions(name, lines):
      if kind is not None:
        collectives[kind].count += times
        collectives[kind].bytes += times * shape_bytes(shape)
      elif opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest:
        kernels[re.sub(r"(\.\d+)+$", "", instruction)] += times
  return ProgramSummary(collectives, dict(sorted(kernels.items())))
