"""Mixture of experts against transformers' MixtralForCausalLM (random weights, built offline) and against itself:
the three compute paths, the balance losses, conversion both ways, decoding, and the one-line errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.llama.modeling_llama import LlamaMLP

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig, MoEConfig
from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES, load_run_config, run_config_from
from llama_jax.inference.engine import Engine
from llama_jax.inference.requests import Collector, Request
from llama_jax.inference.sampler import Sampler
from llama_jax.interop import hf as hf_lib
from llama_jax.interop import hf_config as hf_config_lib
from llama_jax.interop.output import ConvertError
from llama_jax.model import layer_layout, sharding
from llama_jax.model import loss as loss_lib
from llama_jax.model import moe as moe_lib
from llama_jax.model.llama import KVCache, Llama
from llama_jax.training import flops
from tests import hf_utils
from tests.conftest import ROOT
from tests.model.test_llama import abstract_llama, load

torch.set_num_threads(2)
TOL = 1e-5  # float32, the bound for logits, losses and gradients

CASES = {
  "top2_of_8_gqa": dict(n_kv_heads=2, moe=dict(num_experts=8, top_k=2)),
  "top1_of_4": dict(n_kv_heads=4, moe=dict(num_experts=4, top_k=1)),
}


def moe_config(**changes) -> ModelConfig:
  base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)
  base.update(changes)
  base["moe"] = dict(dict(num_experts=8, top_k=2), **base.get("moe", {}))
  return ModelConfig(**base)


def mixtral_and_ours(cfg, tmp_path, seed=0):
  """transformers' model, and ours holding the tensors save_pretrained wrote (through the converter's table)."""
  hf_model = hf_utils.random_hf_mixtral(cfg, seed)
  params = hf_lib.params_from_hf(hf_utils.saved_tensors(hf_model, tmp_path / "hf"), cfg)
  return hf_model, load(abstract_llama(cfg), params)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_router_logits_match_transformers_mixtral(case, tmp_path, monkeypatch):
  cfg = moe_config(**CASES[case])
  hf_model, ours = mixtral_and_ours(cfg, tmp_path)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 48))
  with torch.no_grad():
    out = hf_model(torch.tensor(tokens), output_router_logits=True)
  # Our router logits as the router computes them (the layers run eagerly with scan_layers=False).
  seen = []
  route = moe_lib.route
  monkeypatch.setattr(moe_lib, "route", lambda logits, moe: seen.append(np.asarray(logits)) or route(logits, moe))
  unrolled = load(abstract_llama(cfg.replace(scan_layers=False)), nnx.to_pure_dict(nnx.state(ours)))
  logits = np.asarray(unrolled(jnp.asarray(tokens)))
  monkeypatch.undo()
  diff = np.abs(logits - out.logits.numpy()).max()
  print(f"{case}: max |Δlogit| {diff:.2e} (logits up to {np.abs(logits).max():.2f})")
  assert diff <= TOL
  assert len(seen) == len(out.router_logits) == cfg.n_layers
  for layer, (got, expected) in enumerate(zip(seen, out.router_logits)):
    np.testing.assert_allclose(got, expected.numpy(), atol=TOL, rtol=0, err_msg=f"layer {layer}")
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), logits, atol=TOL, rtol=0)  # the layer scan


@pytest.mark.parametrize("form", ["transformers", "per_layer"])
@pytest.mark.parametrize("case", CASES)
def test_balance_loss_equals_transformers_load_balancing_loss_with_padding(case, form, tmp_path):
  """Right-padded rows: transformers masks padding out of the loss by attention_mask, llama_jax by segment id 0.
  "transformers": its load_balancing_loss_func over every layer's router logits together (what MixtralForCausalLM
  returns as aux_loss); "per_layer": the mean of that function applied to each layer's router logits alone."""
  cfg = moe_config(**CASES[case])
  cfg = cfg.replace(moe=dict(vars(cfg.moe), balance_loss=form))
  hf_model, ours = mixtral_and_ours(cfg, tmp_path)
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (3, 40))
  mask = np.ones_like(tokens)
  mask[1, 29:] = 0
  mask[2, 11:] = 0
  with torch.no_grad():
    out = hf_model(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
  mixtral = transformers.models.mixtral.modeling_mixtral
  if form == "transformers":
    expected = out.aux_loss.item()
  else:
    per_layer = [
      mixtral.load_balancing_loss_func((logits,), cfg.moe.num_experts, cfg.moe.top_k, torch.tensor(mask)).item()
      for logits in out.router_logits
    ]
    expected = float(np.mean(per_layer))
  _, params = nnx.split(ours)
  batch = dict(inputs=jnp.asarray(tokens), targets=jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
  _, _, terms = loss_lib.losses_and_router(params, nnx.graphdef(ours), batch)
  print(f"{case} {form}: balance loss {float(terms['moe_balance']):.6f} vs transformers {expected:.6f}")
  assert abs(float(terms["moe_balance"]) - expected) <= TOL * max(1.0, abs(expected))
  assert abs(float(terms["objective"]) - cfg.moe.aux_loss_weight * expected) <= TOL
  load_LE = np.stack([np.asarray(terms[f"moe_load/{layer}"]) for layer in range(cfg.n_layers)])
  np.testing.assert_allclose(load_LE.sum(axis=-1), 1.0, rtol=1e-6)  # shares of each layer's assignments


def loss_and_grads(cfg, params, batch):
  graphdef = nnx.graphdef(abstract_llama(cfg))

  def objective(p):
    losses, weights, terms = loss_lib.losses_and_router(p, graphdef, batch)
    return jnp.sum(losses * weights) / jnp.sum(weights) + terms["objective"]

  return jax.jit(jax.value_and_grad(objective))(params)


@pytest.mark.parametrize(
  "path",
  [dict(grouped="tiles"), dict(grouped="ragged_dot"), dict(compute="capacity", capacity_factor=4.0)],
  ids=["dropless_tiles", "dropless_ragged_dot", "capacity_without_drops"],
)
def test_compute_paths_give_the_dense_reference_loss_and_gradients(path):
  """Packed segments with padding, GQA, the balance and z losses on: the loss and every gradient of the dropless
  paths (and of the capacity path at a capacity nothing overflows) equal the dense reference's."""
  cfg = moe_config(moe=dict(num_experts=8, top_k=2, z_loss_weight=1e-3, compute="dense"))
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0))))
  rs = np.random.RandomState(2)
  tokens = rs.randint(0, cfg.vocab_size, (2, 64))
  segment_ids = np.repeat([[1] * 20 + [2] * 30 + [0] * 14, [1] * 64], 1, axis=0)
  positions = np.stack([np.r_[np.arange(20), np.arange(30), np.arange(14)], np.arange(64)])
  batch = dict(
    inputs=jnp.asarray(tokens),
    targets=jnp.asarray(np.roll(tokens, -1, axis=1)),
    segment_ids=jnp.asarray(segment_ids),
    positions=jnp.asarray(positions),
    weights=jnp.asarray((segment_ids != 0).astype(np.float32)),
  )
  expected_loss, expected_grads = loss_and_grads(cfg, params, batch)
  other = cfg.replace(moe=dict(vars(cfg.moe), **dict(dict(compute="dropless"), **path)))
  loss, grads = loss_and_grads(other, params, batch)
  np.testing.assert_allclose(float(loss), float(expected_loss), rtol=TOL)
  for (key, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected_grads)):
    scale = float(np.abs(expected).max())
    assert np.abs(np.asarray(got) - expected).max() <= TOL * max(scale, 1.0), jax.tree_util.keystr(key)


def expert_arrays(num_tokens=37, num_experts=4, top_k=2, dim=16, hidden=24, seed=0, skew=0.0):
  """Random tokens, routing and expert weights; `skew` biases the router towards expert 0 (overflowing it)."""
  rs = np.random.RandomState(seed)
  x = jnp.asarray(rs.randn(num_tokens, dim).astype(np.float32))
  logits = rs.randn(num_tokens, num_experts).astype(np.float32)
  logits[:, 0] += skew
  weights, experts, _ = moe_lib.route(jnp.asarray(logits), MoEConfig(num_experts=num_experts, top_k=top_k))
  w = [
    jnp.asarray(rs.randn(*shape).astype(np.float32) * 0.2)
    for shape in [(num_experts, dim, hidden), (num_experts, dim, hidden), (num_experts, hidden, dim)]
  ]
  return x, weights, experts, w


@pytest.mark.parametrize("skew", [0.0, 100.0], ids=["random", "all_to_expert_0"])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_tiles_cover_any_routing(num_tokens, skew):
  """The tile count is a static bound: every assignment on one expert (its group spans many tiles) and a single
  token (tiles of MIN_TILE_ROWS, mostly padding) give the dense reference's output."""
  x, weights, experts, w = expert_arrays(num_tokens=num_tokens, skew=skew)
  expected = moe_lib.dense(x, weights, experts, *w)
  got = jax.jit(lambda *a: moe_lib.dropless(*a, grouped="tiles"))(x, weights, experts, *w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)


def test_capacity_drops_the_later_assignments_past_each_experts_slots_and_counts_them():
  """Half the fair share per expert, most tokens routed to expert 0: the output equals the dense reference with the
  weights of the dropped assignments (an expert's assignments past its U slots, in token order) set to zero."""
  num_tokens, num_experts, top_k = 40, 4, 2
  x, weights, experts, w = expert_arrays(num_tokens, num_experts, top_k, skew=1.5)
  y, dropped = moe_lib.capacity(x, weights, experts, *w, capacity_factor=0.5)
  slots = int(np.ceil(0.5 * num_tokens * top_k / num_experts))
  taken = np.zeros(num_experts, int)
  kept = np.zeros((num_tokens, top_k), bool)
  for m in range(num_tokens):
    for j in range(top_k):
      e = int(experts[m, j])
      kept[m, j] = taken[e] < slots
      taken[e] += 1
  assert 0 < (~kept).mean() < 1
  np.testing.assert_allclose(float(dropped), (~kept).mean(), rtol=1e-6)
  expected = moe_lib.dense(x, weights * jnp.asarray(kept), experts, *w)
  np.testing.assert_allclose(np.asarray(y), np.asarray(expected), atol=1e-5, rtol=1e-5)


def test_convert_round_trip_is_bit_exact_and_transformers_reloads_the_export(tmp_path):
  cfg = moe_config()
  hf_model = hf_utils.random_hf_mixtral(cfg, seed=4)
  saved = hf_utils.saved_tensors(hf_model, tmp_path / "hf")
  got_cfg = hf_lib.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  # router_aux_loss_coef read back as aux_loss_weight, for the loss transformers computes
  assert got_cfg.moe == MoEConfig(**dict(vars(cfg.moe), balance_loss="transformers"))
  hf_lib.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
  back = hf_utils.saved_tensors_in(tmp_path / "back")
  assert sorted(back) == sorted(saved)
  for name, tensor in saved.items():
    assert back[name].dtype == tensor.dtype and np.array_equal(back[name], tensor), name
  config = json.loads((tmp_path / "back" / "config.json").read_text())
  assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 8, 2)
  reloaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
  reloaded = reloaded.eval()
  tokens = torch.tensor(np.random.RandomState(5).randint(0, cfg.vocab_size, (1, 24)))
  with torch.no_grad():
    assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def test_greedy_sampler_and_engine_equal_transformers_generate(tmp_path):
  cfg = moe_config(max_seq_len=256)
  hf_model = hf_utils.random_hf_mixtral(cfg, seed=3)
  hf_model.save_pretrained(str(tmp_path / "hf"))
  hf_lib.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  loaded_cfg, params = checkpoint_params.load_params(str(tmp_path / "ckpt"))
  check_greedy_decoding_equals_generate(hf_model, loaded_cfg, params, 32)


def check_greedy_decoding_equals_generate(hf_model, cfg, params, new_tokens) -> list[list[int]]:
  """Sampler and Engine give transformers' greedy `generate` tokens for two prompts (12 and 5 tokens); returns them."""
  prompts = [np.random.RandomState(s).randint(3, cfg.vocab_size, n).tolist() for s, n in ((1, 12), (2, 5))]
  hf_model.generation_config.eos_token_id = None
  expected = []
  for prompt in prompts:
    with torch.no_grad():
      out = hf_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
      )
    expected.append(out[0, len(prompt) :].tolist())
  sampler = Sampler(cfg, params, eos_id=-1)
  assert sampler.generate(prompts, new_tokens) == expected
  engine = Engine(sampler, slots=2, max_len=64, steps_per_call=4)
  collectors = [Collector() for _ in prompts]
  engine.generate([Request(p, new_tokens, c) for p, c in zip(prompts, collectors)])
  assert [c.tokens for c in collectors] == expected
  return [prompt + tokens for prompt, tokens in zip(prompts, expected)]


def test_mixtral_8x7b_preset_has_mixtrals_parameter_count():
  cfg = run_config_from(load_run_config(f"{ROOT}/configs/mixtral_8x7b.py")).model
  assert cfg.num_params() == 46_702_792_704
  assert cfg.num_active_params() == 12_879_925_248
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) == cfg.num_params()
  mlp = nnx.state(abstract)["layers"]["mlp"]
  assert mlp["w_gate"].get_metadata()["out_sharding"] == ("layers", "expert", "embed", "mlp")


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(moe=dict(num_experts=4, top_k=5)), "model.moe.top_k must be between 1 and num_experts=4, got 5"),
    (dict(moe=dict(num_experts=-1)), "model.moe.num_experts must be ≥ 0"),
    (dict(moe=dict(num_experts=4, compute="sparse")), "model.moe.compute must be one of dropless, capacity, dense"),
    (dict(moe=dict(num_experts=4, aux_loss_weight=-1.0)), "model.moe.aux_loss_weight must be a finite number ≥ 0"),
    (dict(moe=dict(num_expert=4)), r"unknown model.moe keys \['num_expert'\] \(did you mean model.moe.num_experts\?\)"),
    (dict(moe=dict(num_experts=4), quantize="int8"), "quantize='int8' is not built for mixture-of-experts models"),
  ],
)
def test_bad_moe_configs_are_one_line_errors(changes, message):
  with pytest.raises(ConfigError, match=message):
    ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, **changes)


def test_mixtral_configs_llama_jax_cannot_run_are_refused_by_name(tmp_path):
  cfg = moe_config()
  hf_utils.random_hf_mixtral(cfg).save_pretrained(str(tmp_path / "hf"))
  config_path = tmp_path / "hf" / "config.json"
  config = json.loads(config_path.read_text())
  for key, value, message in [
    ("sliding_window", 4096, "sets sliding_window=4096; llama_jax attends over the whole context"),
    ("router_jitter_noise", 0.1, "sets router_jitter_noise=0.1; llama_jax's router adds no noise"),
    ("model_type", "qwen2_moe", "has model_type='qwen2_moe'; supported: llama, mixtral"),
  ]:
    config_path.write_text(json.dumps(dict(config, **{key: value})))
    with pytest.raises(ConvertError, match=message):
      hf_lib.from_hf(str(tmp_path / "hf"), str(tmp_path / f"out_{key}"))
    assert not (tmp_path / f"out_{key}").exists()


def test_model_flops_count_the_experts_a_token_runs():
  dense = moe_config(moe=dict(num_experts=0))
  top2 = moe_config()
  per_expert = 6 * dense.n_layers * 3 * dense.dim * dense.hidden_dim
  router = 6 * dense.n_layers * dense.dim * 8
  assert flops.flops_per_token(top2, 64) - flops.flops_per_token(dense, 64) == per_expert + router
  assert top2.num_active_params() == dense.num_params() + dense.n_layers * (3 * dense.dim * dense.hidden_dim + 64 * 8)


def test_capacity_on_a_mesh_drops_as_without_one():
  """The trainer always runs under a mesh, where the experts run per device (shard_map): on one device that must be
  the same capacity path, dropping the same assignments, as the model called with no mesh."""
  cfg = moe_config(moe=dict(num_experts=4, top_k=2, compute="capacity", capacity_factor=0.5))
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, (2, 32)))
  batch = dict(inputs=tokens, targets=tokens)

  def run():
    losses, _, terms = jax.jit(lambda p: loss_lib.losses_and_router(p, graphdef, batch))(params)
    return float(jnp.mean(losses)), float(terms["moe_dropped"])

  alone = run()
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  with sharding.activate(mesh, DEFAULT_LOGICAL_AXIS_RULES):
    on_mesh = run()
  assert alone[1] > 0.1  # half the fair share per expert: many assignments dropped
  assert on_mesh[1] == alone[1] and on_mesh[0] == pytest.approx(alone[0], rel=TOL)


class _DenseMLP(torch.nn.Module):
  """transformers' LlamaMLP in a Mixtral block's place, returning what the replaced sparse block returned (a
  tuple with router logits in older transformers): a transformers model with MoE in every other block only."""

  def __init__(self, mlp, returns_tuple: bool, num_experts: int):
    super().__init__()
    self.mlp, self.returns_tuple, self.num_experts = mlp, returns_tuple, num_experts

  def forward(self, x):
    out = self.mlp(x)
    if not self.returns_tuple:
      return out
    return out, torch.zeros(x.shape[0] * x.shape[1], self.num_experts, dtype=x.dtype)


def interleaved_mixtral_and_ours(cfg, tmp_path, seed=0):
  """transformers' Mixtral with the sparse blocks of the layers that `cfg.moe.every` leaves dense replaced by
  transformers' LlamaMLP (random weights), and our model of `cfg` holding the same tensors."""
  every1 = cfg.replace(moe=dict(vars(cfg.moe), every=1))
  hf_model = hf_utils.random_hf_mixtral(every1, seed)
  every_block = hf_lib.params_from_hf(hf_utils.saved_tensors(hf_model, tmp_path / "hf"), every1)
  per_layer = layer_layout.layer_params(every_block["layers"])
  llama_config = transformers.LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim, hidden_act="silu")
  torch.manual_seed(seed + 1)
  x = torch.zeros(1, 2, cfg.dim)
  for i, layer in enumerate(hf_model.model.layers):
    if cfg.is_moe_layer(i):
      continue
    name = "block_sparse_moe" if hasattr(layer, "block_sparse_moe") else "mlp"
    with torch.no_grad():
      returns_tuple = isinstance(getattr(layer, name)(x), tuple)
    mlp = LlamaMLP(llama_config).eval()
    with torch.no_grad():
      for p in mlp.parameters():
        p.normal_(0, 0.05)
    setattr(layer, name, _DenseMLP(mlp, returns_tuple, cfg.moe.num_experts))
    per_layer[i] = dict(
      per_layer[i],
      mlp={
        "w_gate": mlp.gate_proj.weight.detach().numpy().T,
        "w_up": mlp.up_proj.weight.detach().numpy().T,
        "w_down": mlp.down_proj.weight.detach().numpy().T,
      },
    )
  return hf_model, dict(every_block, layers=layer_layout.stack_layer_params(per_layer, cfg))


EVERY2 = dict(n_layers=4, n_kv_heads=2, moe=dict(num_experts=4, top_k=2, every=2))


def test_moe_every_second_block_matches_transformers_with_dense_blocks_between(tmp_path):
  """moe.every=2: blocks 1 and 3 are mixtures, 0 and 2 dense SwiGLU, checked against transformers' Mixtral with its
  sparse blocks 0 and 2 replaced by LlamaMLP; the grouped layer scan, the Python loop over groups and the
  per-block (decoding) layout give the same logits, and the router sums are the MoE blocks' only."""
  cfg = moe_config(**EVERY2)
  hf_model, params = interleaved_mixtral_and_ours(cfg, tmp_path)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
  with torch.no_grad():
    expected = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = load(abstract_llama(cfg), params)
  x, router = ours.forward(jnp.asarray(tokens))
  logits = np.asarray(ours.logits(x))
  diff = np.abs(logits - expected).max()
  print(f"moe.every=2: max |Δlogit| {diff:.2e} (logits up to {np.abs(expected).max():.2f})")
  assert diff <= TOL
  assert {leaf.shape[0] for leaf in jax.tree.leaves(router)} == {2}  # one row per MoE block
  loop = load(abstract_llama(cfg.replace(scan_layers=False)), params)
  np.testing.assert_allclose(np.asarray(loop(jnp.asarray(tokens))), logits, atol=TOL, rtol=0)
  unstacked = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=False))
  per_block = load(unstacked, layer_layout.unstack_layers(params))
  assert [type(block.mlp).__name__ for block in per_block.layers] == ["MLP", "MoE", "MLP", "MoE"]
  np.testing.assert_allclose(np.asarray(per_block(jnp.asarray(tokens))), logits, atol=TOL, rtol=0)
  abstract = nnx.state(abstract_llama(cfg))
  assert sum(x.size for x in jax.tree.leaves(abstract)) == cfg.num_params()
  assert abstract["layers"]["blocks"][1]["mlp"]["w_gate"].get_metadata()["out_sharding"] == (
    "layers",
    "expert",
    "embed",
    "mlp",
  )


def test_moe_every_second_block_decodes_as_transformers_generates(tmp_path):
  """Sampler (the per-block layout, placed from the grouped stacked params), Engine and the stacked model's own
  cache all give transformers' greedy tokens."""
  cfg = moe_config(**EVERY2, max_seq_len=256)
  hf_model, params = interleaved_mixtral_and_ours(cfg, tmp_path, seed=4)
  first = check_greedy_decoding_equals_generate(hf_model, cfg, params, 24)[0]
  # The stacked model's cache: its group scan writes block g·every + j's slots.
  stacked = load(abstract_llama(cfg), params)
  prompt = first[:12]
  cache = KVCache.empty(cfg, 1, 64)
  logits, cache = stacked.decode(jnp.asarray([prompt]), None, cache)
  tokens = [int(np.argmax(logits[0, -1]))]
  for _ in range(7):
    logits, cache = stacked.decode(jnp.asarray([[tokens[-1]]]), None, cache)
    tokens.append(int(np.argmax(logits[0, -1])))
  assert tokens == first[12:20]


def test_moe_every_errors_and_the_refused_hf_export(tmp_path):
  with pytest.raises(ConfigError, match=r"model.moe.every=3 must divide n_layers=4"):
    moe_config(n_layers=4, moe=dict(num_experts=4, every=3))
  with pytest.raises(ConfigError, match=r"model.moe.every must be ≥ 1 \(1: every block; k: every k-th block\), got 0"):
    moe_config(moe=dict(num_experts=4, every=0))
  cfg = moe_config(**EVERY2)
  with pytest.raises(ConvertError, match=r"mixture of experts in every 2th block .* HF Mixtral has one in every block"):
    hf_config_lib.check_hf_expressible(cfg)
  dense = moe_config(n_layers=4, moe=dict(num_experts=0))
  per_expert = 6 * 3 * dense.dim * dense.hidden_dim
  assert flops.flops_per_token(cfg, 64) - flops.flops_per_token(dense, 64) == 2 * (per_expert + 6 * dense.dim * 4)
  assert cfg.num_active_params() == dense.num_params() + 2 * (3 * dense.dim * dense.hidden_dim + dense.dim * 4)
