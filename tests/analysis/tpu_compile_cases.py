"""``python -m tests.analysis.tpu_compile_cases OUT.json``: the train step of a small GQA model compiled by the real TPU
compiler for v4-8 and v5e-8 slices (abstract devices: no TPU needed) under fsdp, tensor and data × fsdp meshes, with
splash attention, and of its mixture-of-experts variant on v5p-8 with experts over an expert axis; each case's plan
(memory, collectives, kernels) goes to OUT.json. One process for every case, so libtpu starts once
(tests/analysis/test_tpu_compile.py asserts on the file). ``--xla-blocks OUT.json`` and ``--scale OUT.json``: the
stress tier's context cases (XLA_BLOCK_CASES; the 8B preset at 32,768 tokens)."""

import json
import math
import os
import sys
import tempfile

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only; other processes may have libtpu loaded
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402  (the environment above must be set before jax starts)

from llama_jax.analysis import hlo, tpu
from llama_jax.analysis import train_plan as plan_lib
from llama_jax.core import run_config as run_config_lib

# A GQA model whose shapes splash attention takes (head_dim 64, sequence a multiple of 128) and that every mesh below
# divides (4 kv heads over tensor 4; batch 8 over data × fsdp).
MODEL = dict(
  vocab_size=2048,
  dim=512,
  n_layers=2,
  n_heads=8,
  n_kv_heads=4,
  multiple_of=128,
  max_seq_len=256,
  dtype="bfloat16",
  param_dtype="float32",
  remat="full",
  attention="auto",
)
CASES = {
  "v4-8/fsdp": ("v4-8", dict(data=1, fsdp=4, tensor=1)),
  "v4-8/tensor": ("v4-8", dict(data=1, fsdp=1, tensor=4)),
  "v4-8/data_fsdp": ("v4-8", dict(data=2, fsdp=2, tensor=1)),
  "v5e-8/fsdp": ("v5e-8", dict(data=1, fsdp=8, tensor=1)),
  "v5e-8/fsdp_tensor": ("v5e-8", dict(data=1, fsdp=2, tensor=4)),
  "v5e-8/data_fsdp": ("v5e-8", dict(data=2, fsdp=4, tensor=1)),
}

# The same model with 8 SwiGLU experts (top-2) in every block, on a v5p-8 slice (4 chips).
MOE_MODEL = dict(MODEL, moe=dict(num_experts=8, top_k=2))
# The last case puts the mixture in every other block of 4 (moe.every=2): the scan over groups of two blocks.
MOE_EVERY2_MODEL = dict(MOE_MODEL, n_layers=4, moe=dict(num_experts=8, top_k=2, every=2))
MOE_CASES = {
  "v5p-8/moe_expert4": ("v5p-8", dict(data=1, fsdp=1, expert=4, tensor=1), MOE_MODEL),
  "v5p-8/moe_expert2_fsdp2": ("v5p-8", dict(data=1, fsdp=2, expert=2, tensor=1), MOE_MODEL),
  "v5p-8/moe_fsdp4": ("v5p-8", dict(data=1, fsdp=4, expert=1, tensor=1), MOE_MODEL),
  "v5p-8/moe_every2_expert4": ("v5p-8", dict(data=1, fsdp=1, expert=4, tensor=1), MOE_EVERY2_MODEL),
}

# Context parallelism on v5p-8 (4 chips): one 8,192-token sequence per step, split over context=4 by each strategy,
# against the same step on one chip with the same kernel, the baseline of per-chip activations: splash here (TPU's
# kernel), the XLA blocks in XLA_BLOCK_CASES below.
CONTEXT_MODEL = dict(MODEL, max_seq_len=8192, attention="chunked")
CONTEXT_TRAIN = dict(batch_size=1, seq_len=8192)
LOSS_HEAD_TRAIN = dict(CONTEXT_TRAIN, seq_len=4096)
LOSS_CHUNK = 512
CONTEXT_CASES = {
  # The same step at 128 tokens: its temporaries are the ones that do not grow with the sequence (the gradients and
  # the optimizer update of the parameters, which every context shard holds whole); the rest are the activations.
  "v5p-8/one_chip_128": ("v5p-8", dict(data=1, fsdp=1, context=1, tensor=1), CONTEXT_MODEL),
  # Splash inside each chip's slice (the all-gather strategy, attention "auto" on TPU) against splash on one chip.
  "v5p-8/one_chip_splash_8k": (
    "v5p-8",
    dict(data=1, fsdp=1, context=1, tensor=1),
    dict(CONTEXT_MODEL, attention="auto"),
  ),
  "v5p-8/context4_all_gather_splash_8k": (
    "v5p-8",
    dict(data=1, fsdp=1, context=4, tensor=1),
    dict(CONTEXT_MODEL, attention="auto"),
  ),
  # Splash on the ring's and zigzag's blocks (attention "auto" on TPU), with its own backward pass.
  "v5p-8/context4_ring_splash_8k": (
    "v5p-8",
    dict(data=1, fsdp=1, context=4, tensor=1),
    dict(CONTEXT_MODEL, attention="auto", context_strategy="ring"),
  ),
  "v5p-8/context4_zigzag_splash_8k": (
    "v5p-8",
    dict(data=1, fsdp=1, context=4, tensor=1),
    dict(CONTEXT_MODEL, attention="auto", context_strategy="zigzag"),
  ),
  # The loss in 512-token chunks of each chip's 2,048-token slice on fsdp 2 × context 2 (4,096-token sequences,
  # LOSS_HEAD_TRAIN), the head gathered over fsdp in every chunk, or once per step with its gradient reduced per chunk
  # or once (model.loss_head_once). What is counted is per chunk, so the shorter sequence (half the compile time)
  # checks the same thing as 8,192 tokens in 1,024-token chunks.
  **{
    f"v5p-8/fsdp2_context2_loss_head_once_{once}_4k": (
      "v5p-8",
      dict(data=1, fsdp=2, context=2, tensor=1),
      dict(CONTEXT_MODEL, context_strategy="ring", loss_chunk=LOSS_CHUNK, loss_head_once=once),
    )
    for once in ("none", "weights", "weights_and_gradient")
  },
}
# The same strategies with the XLA blocks (chunked attention by query chunks: GPU's and CPU's kernel, and TPU's when
# splash does not apply) against the same kernel on one chip, and the 128-token step again for their fixed part. The
# stress tier's (`python -m tests.analysis.tpu_compile_cases --xla-blocks OUT`): four more compiles of 8,192 tokens.
XLA_BLOCK_CASES = {
  "v5p-8/one_chip_8k": ("v5p-8", dict(data=1, fsdp=1, context=1, tensor=1), CONTEXT_MODEL),
  "v5p-8/one_chip_128": CONTEXT_CASES["v5p-8/one_chip_128"],
  **{
    f"v5p-8/context4_{strategy}_8k": (
      "v5p-8",
      dict(data=1, fsdp=1, context=4, tensor=1),
      dict(CONTEXT_MODEL, context_strategy=strategy),
    )
    for strategy in ("all_gather", "ring", "zigzag")
  },
}


SCALE_TOKENS = 32768  # `scale_main`'s sequence length


def run_config(mesh: dict, model: dict = MODEL, train: dict | None = None) -> run_config_lib.RunConfig:
  return run_config_lib.RunConfig().replace(model=model, mesh=mesh, train=train or dict(batch_size=8, seq_len=256))


def llama3_8b(context: int, seq_len: int, **model) -> run_config_lib.RunConfig:
  """The Llama 3 8B preset on fsdp 16 × `context` (16 sequences of `seq_len` tokens), with `model` changed."""
  cfg = run_config_lib.load_run_config("configs/llama3_8b.py")
  cfg.mesh.update(data=1, fsdp=16, context=context, tensor=1)
  cfg.train.update(seq_len=seq_len, batch_size=16)
  cfg.model.update(**model)
  return cfg


def scale_main(out: str) -> None:
  """Context 4 at the scale of Llama 3 8B (the preset, 32,768 tokens, 16 sequences, fsdp 16): each strategy's step
  on fsdp 16 × context 4 (64 v5p chips, a quarter sequence per chip) and the same step on fsdp 16 alone (16 chips,
  one sequence per chip), each beside its own step at 128 tokens per chip (the temporaries that do not grow with the
  sequence: the parameters' gradients and update, which the two meshes lay out differently). The temporaries go
  to OUT.json (the stress test in tests/analysis/test_tpu_compile.py divides them)."""
  devices = tpu.tpu_devices("v5p-128")
  results = {}
  for strategy in ("ring", "all_gather", "zigzag"):
    for context in (1, 4) if strategy == "ring" else (4,):
      for seq in (SCALE_TOKENS, 128 * context):
        cfg = llama3_8b(context, seq, max_seq_len=SCALE_TOKENS, context_strategy=strategy)
        plan = plan_lib.plan(cfg, devices[: 16 * context])
        results[f"{strategy}/context{context}/{seq}"] = plan.temp_bytes
  with open(out, "w") as f:
    json.dump(results, f, indent=2)


def main(out: str) -> None:
  results = {}
  devices = {}
  cases = {
    **{case: (*spec, MODEL) for case, spec in CASES.items()},
    **MOE_CASES,
  }
  for case, (topology, mesh, model) in cases.items():
    devices.setdefault(topology, tpu.tpu_devices(topology))
    plan = plan_lib.plan(run_config(mesh, model), devices[topology])
    results[case] = {**dataclasses.asdict(plan), "peak_bytes": plan.peak_bytes}
  results.update(context_plans(CONTEXT_CASES, devices))
  results[SPLASH_GATHER_8B] = splash_gather_at_8b_shapes()
  with open(out, "w") as f:
    json.dump(results, f, indent=2)


def context_plans(cases: dict, devices: dict) -> dict:
  """{case: plan as a dict} of context `cases`, one sequence per batch shard."""
  results = {}
  for case, (topology, mesh, model) in cases.items():
    devices.setdefault(topology, tpu.tpu_devices(topology))
    chips = devices[topology][: math.prod(mesh.values())]
    train = dict(CONTEXT_TRAIN, batch_size=mesh["data"] * mesh["fsdp"])
    train = dict(train, seq_len=128) if case.endswith("_128") else train
    train = dict(train, seq_len=LOSS_HEAD_TRAIN["seq_len"]) if case.endswith("_4k") else train
    plan = plan_lib.plan(run_config(mesh, model, train), chips)
    results[case] = {**dataclasses.asdict(plan), "peak_bytes": plan.peak_bytes}
  return results


def xla_blocks_main(out: str) -> None:
  """XLA_BLOCK_CASES' plans to OUT.json (the stress tier's context tests read them)."""
  with open(out, "w") as f:
    json.dump(context_plans(XLA_BLOCK_CASES, {}), f, indent=2)


SPLASH_GATHER_8B = "v5p-128/8b_2_layers_context4_all_gather_splash_32k"


def splash_gather_at_8b_shapes() -> dict:
  """The all-gather strategy with splash at Llama 3 8B's shapes (the preset cut to 2 layers; 32,768 tokens, 16
  sequences on fsdp 16 × context 4 of v5p-128): its plan and which arrays its collectives produce (the small model's
  shapes never showed the whole-sequence all-reduce of the key and value gradients that these did)."""
  cfg = llama3_8b(4, 32768, n_layers=2, max_seq_len=32768)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "step.hlo")
    plan = plan_lib.plan(cfg, tpu.tpu_devices("v5p-128")[:64], hlo_path=path)
    with open(path) as f:
      shapes = hlo.collective_shapes(f.read())
  return {**dataclasses.asdict(plan), "collective_shapes": [[*key, n] for key, n in sorted(shapes.items())]}


if __name__ == "__main__":
  {"--scale": scale_main, "--xla-blocks": xla_blocks_main}.get(sys.argv[1], lambda _: main(sys.argv[1]))(sys.argv[-1])
