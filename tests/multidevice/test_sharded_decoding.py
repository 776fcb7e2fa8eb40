"""On 8 simulated devices: decoding on a mesh emits the same greedy tokens as one device, with weights and KV cache
split as the decode rules say, restored from a checkpoint straight into shards, and from the CLI."""

import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from llama_jax import sample
from llama_jax.analysis import hlo
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.model_config import ModelConfig
from llama_jax.inference import placement as inference
from llama_jax.inference.sampler import Sampler, load_sampler
from llama_jax.inference.sampling import SamplingConfig
from llama_jax.model import sharding
from llama_jax.model.llama import Llama
from tests.conftest import ROOT, needs_shakespeare

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 (simulated) devices")

BASE = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, multiple_of=32, max_seq_len=256)
# (mesh, kv heads): every device on tensor; batch rows over data; tensor larger than the kv heads (repeated 2×).
CASES = {
  "tensor8_mha": ("tensor=8", 8, 8),
  "data2_tensor4": ("data=2,tensor=4", 4, 8),
  "tensor4_gqa2": ("tensor=4", 2, 4),
}
PROMPTS = [[1, 5, 9, 3], [1, *range(20, 40)], [1, 2, 3]]


def random_params(cfg, seed=0):
  return nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(seed))))


@pytest.mark.parametrize("case", CASES)
def test_sharded_greedy_decoding_equals_one_device_and_splits_weights_and_cache(case):
  spec, kv_heads, n_devices = CASES[case]
  cfg = BASE.replace(n_kv_heads=kv_heads)
  params = random_params(cfg)
  reference = Sampler(cfg, params, eos_id=-1).generate(PROMPTS, 24)
  mesh = inference.decode_mesh(spec, jax.devices()[:n_devices])
  sampler = Sampler(cfg, params, eos_id=-1, mesh=mesh)
  assert sampler.generate(PROMPTS, 24) == reference

  data, tensor = mesh.shape["data"], mesh.shape["tensor"]
  repeats = max(1, tensor // kv_heads)
  assert sampler.cfg.n_kv_heads == kv_heads * repeats
  layer = sampler.params["layers"][0]
  expected_specs = {
    ("attention", "wq"): P(None, "tensor", None),
    ("attention", "wk"): P(None, "tensor", None),
    ("attention", "wo"): P("tensor", None, None),
    ("mlp", "w_gate"): P(None, "tensor"),
    ("mlp", "w_down"): P("tensor", None),
  }
  for (module, name), want in expected_specs.items():
    array = layer[module][name]
    assert array.sharding.spec == want, (module, name, array.sharding.spec)
    assert len({shard.device for shard in array.addressable_shards}) == n_devices
  # Each device holds one kv head of wk after repetition, and query heads n and kv head n // G still pair up:
  # the repeated wk equals the original kv head of every query head's group.
  wk = np.asarray(layer["attention"]["wk"])
  original = np.asarray(params["layers"]["attention"]["wk"][0])
  group = cfg.n_heads // kv_heads
  for n in range(cfg.n_heads):
    np.testing.assert_array_equal(wk[:, n // (cfg.n_heads // sampler.cfg.n_kv_heads)], original[:, n // group])
  assert sampler.params["embed"].sharding.spec == P("tensor", None)

  cache = sampler.empty_cache(4, 48)
  assert cache.k[0].shape == (4, sampler.cfg.n_kv_heads, 48, cfg.head_dim)
  assert cache.k[0].addressable_shards[0].data.shape == (4 // data, sampler.cfg.n_kv_heads // tensor, 48, cfg.head_dim)
  assert inference.per_device_bytes(cache) == sampler.cache_bytes_per_device(4, 48)

  # Weights per device: the split matrices' share plus the replicated norm scales, from the shapes alone.
  decode_cfg = sampler.cfg
  norms = (2 * cfg.n_layers + 1) * cfg.dim
  split = decode_cfg.num_params() - norms
  assert sampler.weight_bytes_per_device() == (split // tensor + norms) * 4


@pytest.mark.parametrize("spec", ["tensor=4", "data=2,tensor=2"])
def test_a_mixture_of_experts_decodes_on_a_mesh_as_on_one_device_with_experts_split_over_tensor(spec):
  """Each expert's SwiGLU split over tensor like the dense MLP (gate and up by columns, down by rows); every device
  routes its rows itself (the experts run per device, in shard_map), so greedy tokens equal one device's."""
  cfg = BASE.replace(n_kv_heads=4, moe=dict(num_experts=4, top_k=2))
  params = random_params(cfg)
  reference = Sampler(cfg, params, eos_id=-1).generate(PROMPTS, 24)
  mesh = inference.decode_mesh(spec, jax.devices()[:4])
  sampler = Sampler(cfg, params, eos_id=-1, mesh=mesh)
  assert sampler.generate(PROMPTS, 24) == reference
  mlp = sampler.params["layers"][0]["mlp"]
  # [E, D, F] and [E, F, D]; the expert axis (size 1 in a decode mesh) keeps its place in the spec.
  assert mlp["w_gate"].sharding.spec == P("expert", None, "tensor")
  assert mlp["w_down"].sharding.spec == P("expert", "tensor", None)


def test_int8_on_a_mesh_with_repeated_kv_heads_equals_int8_on_one_device():
  """Quantized after the kv heads are repeated: the scales of wk and wv repeat with them."""
  cfg = BASE.replace(n_kv_heads=2)
  params = random_params(cfg)
  one = Sampler(cfg, params, eos_id=-1, quantize="int8")
  mesh = inference.decode_mesh("tensor=4", jax.devices()[:4])
  sharded = Sampler(cfg, params, eos_id=-1, mesh=mesh, quantize="int8")
  assert sharded.cfg.quantize == "int8" and sharded.cfg.n_kv_heads == 4
  assert sharded.params["layers"][0]["attention"]["wk_scale"].sharding.spec == P("tensor", None)
  assert sharded.generate(PROMPTS, 16) == one.generate(PROMPTS, 16)
  float_bytes = Sampler(cfg, params, eos_id=-1, mesh=mesh).weight_bytes_per_device()
  assert sharded.weight_bytes_per_device() < float_bytes / 3


def test_decoding_is_one_while_loop_call_with_its_all_reduces_inside():
  """No per-token host round trip: a generation is the prefill and one call of the loop program, which holds the
  tensor-parallel all-reduces and gathers no weight."""
  cfg = BASE.replace(n_kv_heads=4)
  sampler = Sampler(cfg, random_params(cfg), eos_id=-1, mesh=inference.decode_mesh("tensor=4", jax.devices()[:4]))
  prefill_fn, decode_fn = sampler._compiled(SamplingConfig(), 16, (-1,))
  calls = []

  def counting_decode(*args):
    calls.append(args)
    return decode_fn(*args)

  sampler._compiled = lambda *_: (prefill_fn, counting_decode)
  sampler.generate(PROMPTS[:1], 16)
  assert len(calls) == 1
  with sharding.activate(sampler.mesh, sampler.rules):
    text = decode_fn.lower(*calls[0]).compile().as_text()
  collectives = hlo.summarize(text).to_dict()["collectives"]
  # Two all-reduces per layer (after the attention output and the MLP-out products, split by rows) and one for the
  # embedding lookup of the vocabulary-split table; the all-gathers move a few ints per row (the sampled tokens),
  # never a weight (the smallest split matrix here is 4 KiB).
  assert collectives["all-reduce"]["count"] == 2 * cfg.n_layers + 1, collectives
  assert collectives.get("all-gather", {"bytes": 0})["bytes"] <= 64, collectives
  assert " while(" in text


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, small_tokenizer):
  cfg = BASE.replace(vocab_size=512, n_kv_heads=2)
  directory = str(tmp_path_factory.mktemp("ckpt") / "model")
  checkpoint_params.save_params_dir(directory, cfg, random_params(cfg, seed=3), tokenizer_path=small_tokenizer)
  return directory


def test_checkpoint_restores_into_decode_shards_with_no_device_holding_more_than_its_share(checkpoint_dir):
  mesh = inference.decode_mesh("tensor=8")
  sampler, _ = load_sampler(checkpoint_dir, mesh, dtype="bfloat16")
  cfg = sampler.cfg
  assert cfg.param_dtype == cfg.dtype == "bfloat16" and cfg.n_kv_heads == 8  # 2 kv heads repeated 4×
  for path, leaf in jax.tree_util.tree_leaves_with_path(sampler.params):
    assert leaf.dtype == np.dtype("bfloat16"), path
    share = math.prod(leaf.sharding.shard_shape(leaf.shape))
    for shard in leaf.addressable_shards:
      assert shard.data.size == share, path
    if leaf.ndim > 1:
      assert share * 8 == leaf.size, (path, leaf.shape, leaf.sharding.spec)  # every matrix split 8 ways
  norms = (2 * cfg.n_layers + 1) * cfg.dim
  assert sampler.weight_bytes_per_device() == ((cfg.num_params() - norms) // 8 + norms) * 2
  one, _ = load_sampler(checkpoint_dir, inference.decode_mesh("tensor=1", jax.devices()[:1]), dtype="bfloat16")
  prompts = [[1, 40, 41, 42], [1, 7]]
  assert sampler.generate(prompts, 16) == one.generate(prompts, 16)


def run_sample(*args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", "llama_jax.sample", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )


def test_cli_decodes_on_a_mesh_like_on_one_device(checkpoint_dir, capsys):
  common = ["--checkpoint", checkpoint_dir, "--prompt", "Shall I compare thee", "--prompt", "To be", "--temperature"]
  common += ["0", "--max_new_tokens", "12"]
  sharded = run_sample(*common, "--mesh", "data=2,tensor=4")
  single = run_sample(*common, "--mesh", "tensor=1")
  assert sharded.returncode == 0 and single.returncode == 0, sharded.stderr + single.stderr
  assert sharded.stdout == single.stdout and sharded.stdout.count("-" * 40) == 2
  mesh_line = "decoding on mesh {'data': 2, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 4} of 8 cpu device(s)"
  assert mesh_line in sharded.stderr
  assert "of 1 cpu device(s)" in single.stderr
  for mesh, message in (
    ("tensor=3", "a tensor axis of 3 devices does not fit 2 kv heads and 8 query heads"),
    ("data=3,tensor=-1", "mesh axes other than -1 multiply to 3, which does not divide the 8 devices"),
    ("fsdp=8", "decoding does not use fsdp"),
    ("tensor:8", "--mesh takes AXIS=SIZE pairs such as data=1,tensor=-1, got 'tensor:8'"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      sample.main([*common, "--mesh", mesh])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr, stderr


@needs_shakespeare
def test_evaluate_on_a_mesh_gives_the_single_device_loss(checkpoint_dir):
  from llama_jax.inference import evaluation as evaluate

  def loss(mesh):
    args = dict(seq_len=32, batch_size=4, max_batches=2, mesh=inference.decode_mesh(mesh))
    return evaluate.evaluate(checkpoint_dir, ["shakespeare:sonnets"], **args)

  one, sharded = loss("tensor=1"), loss("data=2,tensor=4")
  assert one["tokens"] == sharded["tokens"] == 2 * 4 * 32
  np.testing.assert_allclose(sharded["loss"], one["loss"], rtol=1e-5)
