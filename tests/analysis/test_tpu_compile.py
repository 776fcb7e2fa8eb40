"""The TPU code paths compiled by the real TPU compiler (libtpu, the `tpu-aot` extra) for v4-8 and v5e-8 slices on this
CPU-only machine: the train step of a small GQA model under fsdp, tensor and data × fsdp meshes compiles, with splash
attention in every layer, parameters split as the mesh says, and the collectives that mesh implies."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from llama_jax.core.model_config import ModelConfig
from tests import XLA_TEST_FLAGS
from tests.analysis.tpu_compile_cases import (
  CASES,
  CONTEXT_MODEL,
  CONTEXT_TRAIN,
  LOSS_CHUNK,
  LOSS_HEAD_TRAIN,
  MODEL,
  MOE_CASES,
  SCALE_TOKENS,
  SPLASH_GATHER_8B,
)
from tests.conftest import ROOT

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
if not HAVE_LIBTPU and os.environ.get("CI") == "true":
  raise RuntimeError('libtpu is not installed: CI installs the tpu-aot extra (pip install -e ".[tpu-aot]")')
pytestmark = pytest.mark.skipif(not HAVE_LIBTPU, reason='needs libtpu: pip install -e ".[tpu-aot]"')


def tpu_compiler_json(out, module: str, *args: str, timeout: int) -> dict:
  """`python -m module *args` in a subprocess with libtpu allowed beside other processes' (compiling only), and the
  JSON it writes to `out`. XLA_FLAGS without the suite's XLA_TEST_FLAGS: the TPU compiler gets the options a user's
  compile has."""
  xla_flags = os.environ.get("XLA_FLAGS", "").replace(XLA_TEST_FLAGS, "").strip()
  result = subprocess.run(
    [sys.executable, "-m", module, *args],
    cwd=ROOT,
    env=dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert result.returncode == 0, result.stderr[-5000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
  out = tmp_path_factory.mktemp("tpu") / "plans.json"
  # Every case compiles in one process: ~6 minutes alone on 2 cores; over 15 beside other jobs on the same cores.
  return tpu_compiler_json(out, "tests.analysis.tpu_compile_cases", str(out), timeout=2400)


@pytest.fixture(scope="module")
def xla_block_plans(tmp_path_factory):
  """The context strategies with the XLA blocks and their one-chip baseline (XLA_BLOCK_CASES): the stress tier's."""
  out = tmp_path_factory.mktemp("tpu_xla_blocks") / "plans.json"
  return tpu_compiler_json(out, "tests.analysis.tpu_compile_cases", "--xla-blocks", str(out), timeout=2400)


def mesh_product(plan, *axes):
  product = 1
  for axis in axes:
    product *= plan["mesh"][axis]
  return product


@pytest.mark.parametrize("case", CASES)
def test_train_step_compiles_for_tpu_with_splash_in_every_layer(plans, case):
  plan = plans[case]
  assert plan["compiler"] == "TPU compiler" and plan["device_kind"].startswith("TPU")
  assert plan["attention"] == "splash"
  kernels = plan["kernels"]
  # Forward once per layer, and again in the backward pass (remat "full" recomputes it), then dq and dkv per layer.
  layers = MODEL["n_layers"]
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_fwd")) == 2 * layers, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dq")) == layers, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dkv")) == layers, kernels


@pytest.mark.parametrize("case", CASES)
def test_parameters_are_split_over_fsdp_and_tensor(plans, case):
  """Per chip 1/(fsdp·tensor) of the parameters (the data axis replicates them), within 5%: norm scales and the
  vocabulary-sharded embedding are the only exceptions and are small here."""
  plan = plans[case]
  total = plan["n_params"] * 4  # float32 storage
  share = total / mesh_product(plan, "fsdp", "tensor")
  assert abs(plan["params_bytes"] - share) <= 0.05 * share, (plan["params_bytes"], share)
  assert plan["opt_state_bytes"] == pytest.approx(2 * plan["params_bytes"], rel=0.01)  # AdamW's two moments


def traffic(plan, kind):
  """Bytes per chip and step of one kind of collective, rings inside matmuls included, in units of the model's
  parameters in bfloat16 (the compute dtype: what gathered weights and their gradients weigh)."""
  collectives = plan["collectives"]
  total = collectives[kind]["bytes"] + collectives.get(f"{kind} in matmul", {"bytes": 0})["bytes"]
  return total / (plan["n_params"] * 2)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1]["fsdp"] > 1])
def test_fsdp_gathers_weights_and_reduce_scatters_gradients(plans, case):
  plan = plans[case]
  # Every weight is gathered at least once per step (forward; the backward gathers again or keeps it).
  assert traffic(plan, "all-gather") >= 1.0, plan["collectives"]
  # Gradients leave by reduce-scatter: each chip receives only its shard's sum.
  assert traffic(plan, "reduce-scatter") > 0.2, plan["collectives"]
  if plan["mesh"]["data"] == 1 and plan["mesh"]["tensor"] == 1:
    # Pure FSDP: every gradient is reduced exactly once (most by reduce-scatter, the rest, e.g. the replicated norm
    # scales, by all-reduce); never a whole-gradient all-reduce on top.
    assert traffic(plan, "reduce-scatter") >= 0.5, plan["collectives"]
    assert 0.95 <= traffic(plan, "reduce-scatter") + traffic(plan, "all-reduce") <= 1.1, plan["collectives"]


def test_tensor_parallel_sums_activations_and_gathers_no_weights(plans):
  plan = plans["v4-8/tensor"]
  # Row-parallel projections (wo, down) end in all-reduces of activations, forward and backward; with no fsdp axis
  # no weight is gathered and no gradient scattered.
  assert plan["collectives"]["all-reduce"]["count"] >= 2 * MODEL["n_layers"], plan["collectives"]
  assert traffic(plan, "all-gather") == 0 and traffic(plan, "reduce-scatter") == 0, plan["collectives"]


@pytest.mark.parametrize("case", CASES)
def test_a_tpu_chip_holds_the_compiled_step(plans, case):
  assert 0 < plans[case]["peak_bytes"] < 16 * 2**30  # a v5e chip's HBM, the smaller of the two


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_step_compiles_with_grouped_matmul_kernels_and_experts_split_over_the_expert_axis(plans, case):
  """The mixture of experts on v5p-8: the TPU compiler turns the grouped matmuls (ragged_dot) into its ragged-dot
  kernels; expert weights are 1/(expert·fsdp) per chip and the rest 1/fsdp (within 5%); with an expert axis the
  tokens travel by all-to-all, at least the send buffers' bytes (forward and backward, per layer); without one, the
  tokens stay on their chip (no all-reduce of the batch's tokens: under 5% of the weights' bytes). With moe.every=2
  only the MoE blocks (half of them) count."""
  plan = plans[case]
  mesh = plan["mesh"]
  cfg = ModelConfig(**MOE_CASES[case][2])
  assert plan["compiler"] == "TPU compiler" and plan["attention"] == "splash"
  assert plan["n_params"] == cfg.num_params()
  grouped = sum(n for kernel, n in plan["kernels"].items() if kernel.startswith("ragged-dot"))
  assert grouped >= 3 * cfg.n_moe_layers, plan["kernels"]  # gate, up and down of each MoE block, forward alone
  expert_bytes = cfg.n_moe_layers * cfg.moe.num_experts * 3 * cfg.dim * cfg.hidden_dim * 4
  expected = expert_bytes / (mesh["expert"] * mesh["fsdp"]) + (plan["n_params"] * 4 - expert_bytes) / mesh["fsdp"]
  assert abs(plan["params_bytes"] - expected) <= 0.05 * expected, (plan["params_bytes"], expected)
  all_to_all = plan["collectives"]["all-to-all"]
  if mesh["expert"] > 1:
    tokens_per_chip = 8 * 256 // (mesh["expert"] * mesh["fsdp"] * mesh["data"])
    assignments = tokens_per_chip * cfg.moe.top_k
    send_buffer = mesh["expert"] * assignments * cfg.dim * 2  # P destinations × C = A slots × D, bfloat16
    assert all_to_all["bytes"] >= 4 * cfg.n_moe_layers * send_buffer, all_to_all
  else:
    assert traffic(plan, "all-reduce") < 0.05, plan["collectives"]
  assert 0 < plan["peak_bytes"] < 95 * 2**30  # a v5p chip's HBM


# Each strategy's activations per chip on context=4, as a share of one chip's: a quarter plus what the strategy adds.
CONTEXT_SHARE = {"all_gather": (0.25 * 0.85, 0.25 * 1.35), "ring": (0.25 * 0.85, 0.25 * 1.35), "zigzag": (0.25, 0.5)}


@pytest.mark.stress
@pytest.mark.parametrize("strategy", ["all_gather", "ring", "zigzag"])
def test_context_parallel_step_holds_about_a_quarter_of_one_chip_s_activations_on_context_4(xla_block_plans, strategy):
  """8,192 tokens split over context=4 on v5p-8 against the same step on one chip (same chunked XLA kernel).
  Activations are the temporaries beyond the 128-token step's (which are the parameters' gradients and update,
  whole on every context shard): a quarter of the one chip's plus what each strategy adds (measured, libtpu
  0.0.42.1: all-gather 0.29, the gathered keys and values and their whole-sequence gradients; ring 0.32, each step's
  running output and block of keys and values kept for the backward pass; zigzag 0.43, its two half-block merges
  per step, not analysed further). The exchange is each strategy's: keys and values gathered (and their gradients
  reduce-scattered), or passed round the ring by collective-permutes, at least 3 blocks of keys and values per
  layer forward."""
  one, plan = xla_block_plans["v5p-8/one_chip_8k"], xla_block_plans[f"v5p-8/context4_{strategy}_8k"]
  fixed = xla_block_plans["v5p-8/one_chip_128"]["temp_bytes"]
  assert plan["compiler"] == "TPU compiler" and plan["attention"] == f"context {strategy} (xla blocks)"
  ratio = (plan["temp_bytes"] - fixed) / (one["temp_bytes"] - fixed)
  low, high = CONTEXT_SHARE[strategy]
  assert low <= ratio <= high, ratio
  collectives = plan["collectives"]
  block_bytes = CONTEXT_TRAIN["seq_len"] // 4 * CONTEXT_MODEL["n_kv_heads"] * 64 * 2  # C × K × H, bfloat16
  if strategy != "all_gather":
    assert collectives["collective-permute"]["bytes"] >= CONTEXT_MODEL["n_layers"] * 3 * 2 * block_bytes, collectives
    assert collectives["all-gather"]["count"] == 0, collectives
  else:
    assert collectives["all-gather"]["bytes"] >= CONTEXT_MODEL["n_layers"] * 2 * 4 * block_bytes, collectives
    assert collectives["collective-permute"]["count"] == 0, collectives


def test_splash_runs_inside_each_chip_s_slice_of_the_all_gather_strategy(plans):
  """Context=4 with attention "auto" on TPU: splash attends each chip's 2,048 queries to the gathered 8,192 keys (its
  mask tables split by query rows), forward twice per layer (remat), dq and dkv once. Activations per chip, against
  splash on one chip: a quarter, plus one layer's gathered keys and values and their whole-sequence float32
  gradients, which every chip holds whole (the all-gather strategy's price; measured, libtpu 0.0.42.1, 512-token
  splash blocks: 0.33 of one chip's with them, 0.23 without; 115 MiB against the XLA blocks' 141 MiB)."""
  one, plan = plans["v5p-8/one_chip_splash_8k"], plans["v5p-8/context4_all_gather_splash_8k"]
  fixed = plans["v5p-8/one_chip_128"]["temp_bytes"]
  assert one["attention"] == "splash" and plan["attention"] == "context all_gather (splash)"
  kernels = plan["kernels"]
  layers = CONTEXT_MODEL["n_layers"]
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_fwd")) == 2 * layers, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dq")) == layers, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dkv")) == layers, kernels
  tokens_kv_heads = CONTEXT_TRAIN["seq_len"] * CONTEXT_MODEL["n_kv_heads"] * 64
  gathered_one_layer = tokens_kv_heads * 2 * (2 + 4)  # keys and values in bfloat16, their gradients in float32
  ratio = (plan["temp_bytes"] - fixed - gathered_one_layer) / (one["temp_bytes"] - fixed)
  assert 0.25 * 0.85 <= ratio <= 0.25 * 1.15, ratio
  collectives = plan["collectives"]
  assert collectives["all-gather"]["bytes"] >= layers * 2 * tokens_kv_heads * 2, collectives
  assert collectives["collective-permute"]["count"] == 0, collectives


def elements(shape: str) -> int:
  """Elements of one array shape `bf16[1,32768,8,128]` (0 for a tuple)."""
  if shape.startswith("("):
    return 0
  dims = shape[shape.index("[") + 1 : -1]
  return math.prod(int(d) for d in dims.split(",") if d)


def test_splash_inside_all_gather_slices_reduce_scatters_the_key_and_value_gradients_at_8b_shapes(plans):
  """At Llama 3 8B's shapes (2 layers, 32,768 tokens on fsdp 16 × context 4 of v5p-128) the gathered keys' and
  values' gradients are reduce-scattered to their slices, never all-reduced whole: the compiler had turned the
  plain all-gather's transposed reduce-scatter into an all-reduce of the whole sequence and a slice, as splash lays
  out heads before positions (before: 2 all-reduces of bf16[1,32768,8,128] per layer; with `_gather_slices`: 2
  reduce-scatters of bf16[1,1,8192,8,128]; 7B at 32,768 on the same mesh: all-reduces 17.26 → 1.26 GiB per chip)."""
  plan = plans[SPLASH_GATHER_8B]
  assert plan["attention"] == "context all_gather (splash)"
  whole = 32768 * 8 * 128  # a sequence's keys (or values): tokens × kv heads × head dim
  found = {(kind, elements(shape)): n for kind, shape, n in plan["collective_shapes"]}
  assert ("all-reduce", whole) not in found, plan["collective_shapes"]
  assert found.get(("reduce-scatter", whole // 4), 0) >= 2, plan["collective_shapes"]


SPLASH_RING_SHARE = {"ring": 0.36, "zigzag": 0.46}


@pytest.mark.parametrize("strategy", ["ring", "zigzag"])
def test_splash_runs_on_every_block_of_the_ring_and_zigzag_with_its_own_backward_pass(plans, strategy):
  """Context=4 with attention "auto" on TPU: splash computes every block the strategy attends (the ring's 4 a layer,
  zigzag's own block and two half blocks a step after it: 7), forward twice per layer (remat), and its backward
  kernels (dq, dkv) once per block, given the whole rows' output and log-sum-exp. The blocks go round the ring once
  more in the backward pass with their key and value gradients: collective-permutes carry at least the forward's
  blocks (twice, remat) and the backward's, and nothing is gathered. Per chip the step holds fewer temporaries than
  the XLA blocks' and its activations are at most SPLASH_RING_SHARE of splash's on one chip (measured, libtpu
  0.0.42.1: ring 116.6 MiB against the XLA blocks' 150.7, activations 0.335 of one chip's; zigzag 138.4 against
  192.1, 0.43). Above a quarter by one layer's ring state: the float32 running output, the next block in flight,
  the key and value gradients going round and a block's 128-lane log-sum-exp (~21 MiB over splash on one chip at
  2,048 tokens). Without the optimization barrier between steps the ring's share was 0.42."""
  plan, one = plans[f"v5p-8/context4_{strategy}_splash_8k"], plans["v5p-8/one_chip_splash_8k"]
  fixed = plans["v5p-8/one_chip_128"]["temp_bytes"]
  ratio = (plan["temp_bytes"] - fixed) / (one["temp_bytes"] - fixed)
  assert ratio <= SPLASH_RING_SHARE[strategy], ratio
  assert plan["attention"] == f"context {strategy} (splash)"
  products = 4 if strategy == "ring" else 1 + 2 * 3
  layers = CONTEXT_MODEL["n_layers"]
  kernels = plan["kernels"]
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_fwd")) == 2 * layers * products, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dq")) == layers * products, kernels
  assert sum(n for k, n in kernels.items() if k.startswith("splash_mqa_dkv")) == layers * products, kernels
  collectives = plan["collectives"]
  block_bytes = CONTEXT_TRAIN["seq_len"] // 4 * CONTEXT_MODEL["n_kv_heads"] * 64 * 2  # C × K × H, bfloat16
  forward = 3 * 2 * block_bytes  # 3 steps' blocks of keys and values, a layer
  assert collectives["collective-permute"]["bytes"] >= layers * 3 * forward, collectives
  assert collectives["all-gather"]["count"] == 0, collectives


@pytest.mark.stress
@pytest.mark.parametrize("strategy", ["all_gather", "ring", "zigzag"])
def test_splash_in_the_slices_holds_fewer_temporaries_than_the_xla_blocks(plans, xla_block_plans, strategy):
  """Each strategy's step with splash against the same with the XLA blocks, on context 4 at 8,192 tokens: fewer
  temporaries per chip; the rings with splash send more by collective-permute (the blocks go round once more in the
  backward pass, with their key and value gradients)."""
  plan = plans[f"v5p-8/context4_{strategy}_splash_8k"]
  xla_blocks = xla_block_plans[f"v5p-8/context4_{strategy}_8k"]
  assert plan["temp_bytes"] < xla_blocks["temp_bytes"], (plan["temp_bytes"], xla_blocks["temp_bytes"])
  if strategy != "all_gather":
    sent = [p["collectives"]["collective-permute"]["bytes"] for p in (plan, xla_blocks)]
    assert sent[0] > sent[1], sent


def test_the_loss_head_once_gathers_it_once_and_with_its_gradient_reduces_it_once(plans):
  """model.loss_head_once on fsdp 2 × context 2, the loss in 4 chunks of each chip's 2,048-token slice. "weights":
  the head is gathered once per step instead of in each chunk's forward and rematerialised forward (8 gathers of its
  bfloat16 copy), reductions and memory unchanged; "weights_and_gradient": its gradient is also reduced once instead
  of per chunk, for a whole float32 gradient held over the loss. Measured (libtpu 0.0.42.1), none / weights /
  weights_and_gradient: all-gathers 45 / 38 / 38 (43.5 / 29.5 / 29.5 MiB), reduce-scatters 18 / 18 / 14 (27.2 / 27.2
  / 11.2 MiB), all-reduces 11.6 / 11.6 / 13.6 MiB, temporaries 113.84 / 113.78 / 119.72 MiB; the collectives are
  those of 8,192-token sequences in 4 chunks of 1,024 tokens, which compile twice as long."""
  none, weights, both = (
    plans[f"v5p-8/fsdp2_context2_loss_head_once_{once}_4k"] for once in ("none", "weights", "weights_and_gradient")
  )
  chunks = LOSS_HEAD_TRAIN["seq_len"] // 2 // LOSS_CHUNK
  head_bf16 = CONTEXT_MODEL["vocab_size"] * CONTEXT_MODEL["dim"] * 2

  def collective(plan, kind, what="bytes"):
    return plan["collectives"][kind][what]

  def reduced(plan):
    return collective(plan, "reduce-scatter") + collective(plan, "all-reduce")

  gathers = [collective(plan, "all-gather", "count") for plan in (none, weights, both)]
  assert gathers[0] - gathers[1] >= 2 * chunks - 2 and gathers[1] == gathers[2], gathers
  assert collective(none, "all-gather") - collective(weights, "all-gather") >= (2 * chunks - 2) * head_bf16
  assert reduced(weights) == reduced(none)
  assert weights["temp_bytes"] <= none["temp_bytes"] + head_bf16, (weights["temp_bytes"], none["temp_bytes"])
  assert reduced(weights) - reduced(both) >= (chunks - 1) * head_bf16, (reduced(weights), reduced(both))
  assert 0 < both["temp_bytes"] - weights["temp_bytes"] <= 4 * head_bf16, (both["temp_bytes"], weights["temp_bytes"])


@pytest.mark.stress
def test_at_8b_scale_each_chip_holds_a_quarter_of_one_chip_s_activations_within_15_percent_on_context_4(tmp_path):
  """The Llama 3 8B preset at 32,768 tokens (16 sequences, fsdp 16, splash): on fsdp 16 × context 4 each chip's
  activations (temporaries beyond the same mesh's step at 128 tokens per chip) against one chip's whole sequence on
  fsdp 16 alone. Measured (libtpu 0.0.42.1): ring 0.2857, all_gather 0.2857, zigzag 0.2954: a quarter within 15%
  for the ring and the all-gather strategy, zigzag 18% above (its two half-block products a step). The small model
  of the default tests shows 0.29–0.43: there one layer's exchange state weighs as much as its activations.
  Eight compiles of the 8B step: ~4 minutes."""
  out = tmp_path / "scale.json"
  temps = tpu_compiler_json(out, "tests.analysis.tpu_compile_cases", "--scale", str(out), timeout=1800)
  tokens = SCALE_TOKENS
  one = temps[f"ring/context1/{tokens}"] - temps["ring/context1/128"]
  shares = {
    s: (temps[f"{s}/context4/{tokens}"] - temps[f"{s}/context4/512"]) / one for s in ("ring", "all_gather", "zigzag")
  }
  assert 0.25 * 0.85 <= shares["ring"] <= 0.25 * 1.15, shares
  assert 0.25 * 0.85 <= shares["all_gather"] <= 0.25 * 1.15, shares
  assert 0.25 * 0.85 <= shares["zigzag"] <= 0.25 * 1.25, shares


def small_decode_plan(out, *flags: str) -> dict:
  """`plan --decode` of a 2-layer, head_dim-128 model (8 rows × 2,048 slots) on one v5p chip by the TPU compiler."""
  overrides = ["--config.model.dim=256", "--config.model.n_heads=2", "--config.model.n_kv_heads=2"]
  overrides += ["--config.model.n_layers=2", "--config.model.max_seq_len=2048"]
  args = ["--decode", "--config", "configs/tiny.py", *overrides, "--topology", "v5p-8", "--devices", "1"]
  args += ["--batch", "8", "--max_len", "2048", *flags, "--json", str(out)]
  plan = tpu_compiler_json(out, "llama_jax.plan", *args, timeout=600)
  assert plan["compiler"] == "TPU compiler"
  return plan


@pytest.fixture(scope="module")
def prefill_plans(tmp_path_factory) -> dict[int, dict]:
  """`plan --decode` of 8 rows × 2,048 prompt tokens, whole (0) and in chunks of 256 tokens: {chunk: plan}."""
  out = tmp_path_factory.mktemp("decode_plans")
  plans = {}
  for chunk in (0, 256):
    plans[chunk] = small_decode_plan(out / f"{chunk}.json", "--prefill_len", "2048", "--prefill_chunk", str(chunk))
    assert plans[chunk]["prefill_chunk"] == chunk
  return plans


def test_decode_loop_on_tpu_keeps_the_kv_cache_in_place(prefill_plans):
  """The sampler's decode loop compiled by the TPU compiler (one v5p chip, head_dim 128): its temporaries are a
  small fraction of the KV cache (7 MiB for a 64 MiB cache). With a row-major cache the compiler copied the cache
  into its slot-major order at loop entry and back at exit (39 MiB here; 17 GiB for a 16 GiB 7B cache);
  sample.SLOT_MAJOR stores it that way. (The decode loop is the same program whatever the prompt's prefill.)"""
  for plan in prefill_plans.values():
    assert plan["decode"]["temp_bytes"] < 0.25 * plan["cache_bytes"], plan


def test_chunked_prefill_on_tpu_needs_a_fraction_of_the_whole_prompt_s_temporaries(prefill_plans):
  """The sampler's prefill of 8 rows × 2,048 tokens compiled by the TPU compiler (one v5p chip), whole and in chunks of
  256 tokens: the chunked program's temporaries (attention scores [chunk × cache] instead of [prompt × cache]) are
  under half the whole prompt's (measured: 116 MiB against 310 MiB)."""
  temp = {chunk: plan["prefill"]["temp_bytes"] for chunk, plan in prefill_plans.items()}
  assert temp[256] < temp[0] / 2, temp
