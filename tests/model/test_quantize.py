"""Weight-only int8: the quantizer's rounding bound, the int8 model's structure and numbers in both layouts, a tiny
trained model's loss and greedy text with int8 weights, and the run config refusing to train one.

Tolerances. Per-channel int8 moves each weight by at most scale/2 = max|w|/254 (~0.4% of a channel's largest
weight, under 1% rms of a Gaussian channel's weights); through two layers of random weights (std 0.1, channels of
different sizes, logits up to ~5) the logits move by 2.4% rms of their size (max 0.14), held to 5%. Weights that are
exact multiples of their scale leave only float32 rounding (each product is summed before it is scaled): held to
1e-5 absolute, measured 3e-6, where a scale on the wrong axis or applied to a product's input moves logits by ≥ 0.1.
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import RunConfig
from llama_jax.inference.placement import per_device_bytes
from llama_jax.model import layer_layout, quantize
from llama_jax.model import llama as model_lib
from tests.conftest import needs_shakespeare

# GQA; a square MLP (F = D) and N·H = D, so that a scale read on the wrong axis of an MLP weight, or applied to the
# input of wo, still runs and must be caught by the numbers.
SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=128)
RANDOM_TOL = 0.05  # relative rms difference of the logits, int8 vs float32 on random weights
EXACT_TOL = 1e-5  # int8 vs float32 when every weight is a multiple of its scale


def small_config(**changes) -> ModelConfig:
  return ModelConfig(**{**SMALL, **changes})


def abstract_params(cfg: ModelConfig, stacked: bool = True) -> dict:
  abstract = nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=stacked))
  return nnx.to_pure_dict(nnx.state(abstract))


def graphdef_of(cfg: ModelConfig, stacked: bool = True) -> nnx.GraphDef:
  return nnx.graphdef(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=stacked)))


def random_params(cfg: ModelConfig, seed: int, std: float = 0.1) -> dict:
  """Stacked float32 params: weights N(0, std) with a spread of channel sizes, norm scales near 1."""
  rng = np.random.RandomState(seed)

  def one(path, leaf):
    if path[-1].key == "scale":
      return (1 + 0.1 * rng.randn(*leaf.shape)).astype(np.float32)
    # Channels of different sizes (as in trained weights), so a scale on the wrong axis cannot pass by chance.
    return (std * rng.randn(*leaf.shape) * np.exp(0.3 * rng.randn(*leaf.shape[-1:]))).astype(np.float32)

  return jax.tree_util.tree_map_with_path(one, abstract_params(cfg))


# Compiled once per config and shared between tests: compilation is most of this file's time.
@functools.cache
def forward_fn(cfg: ModelConfig):
  graphdef = graphdef_of(cfg)
  return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


@functools.cache
def decode_fn(cfg: ModelConfig):
  graphdef = graphdef_of(cfg, stacked=False)
  return jax.jit(lambda params, tokens, cache: nnx.merge(graphdef, params).decode(tokens, None, cache))


def forward(cfg: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
  """Float32 logits of the stacked model's __call__ (the scan evaluation runs)."""
  return np.asarray(forward_fn(cfg)(params, jnp.asarray(tokens)))


def cached_decode(cfg: ModelConfig, params: dict, tokens: np.ndarray, prefill: int) -> np.ndarray:
  """Float32 logits of `Llama(stacked_layers=False).decode` with a per-layer KV cache (the sampler's layout): the
  first `prefill` tokens in one call, then one token per call."""
  step = decode_fn(cfg)
  unstacked = layer_layout.unstack_layers(params)
  cache = model_lib.KVCache.empty(cfg, tokens.shape[0], tokens.shape[1], per_layer=True)
  logits, cache = step(unstacked, jnp.asarray(tokens[:, :prefill]), cache)
  out = [np.asarray(logits)]
  for i in range(prefill, tokens.shape[1]):
    logits, cache = step(unstacked, jnp.asarray(tokens[:, i : i + 1]), cache)
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# The quantizer


WEIGHT_KINDS = {
  "wq [D, N, H]": ((64, 4, 16), "wq"),
  "wo [N, H, D]": ((4, 16, 64), "wo"),
  "w_down [F, D]": ((96, 64), "w_down"),
  "embed [V, D] per row": ((256, 64), "embed"),
  "stacked wq [L, D, N, H]": ((3, 64, 4, 16), "wq"),
}


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_quantize_int8_error_per_channel_is_within_half_a_step_and_zeros_round_trip(kind):
  shape, name = WEIGHT_KINDS[kind]
  axes = quantize.INT8_CONTRACT_AXES[name]
  rng = np.random.RandomState(0)
  w = (rng.randn(*shape) * np.exp(rng.randn(*shape[-1:]))).astype(np.float32)
  contracted = {a % len(shape) for a in axes}
  zero_channel = tuple(slice(None) if i in contracted else 0 for i in range(len(shape)))
  w[zero_channel] = 0.0
  q, scale = quantize.quantize_int8(jnp.asarray(w), axes)
  q, scale = np.asarray(q), np.asarray(scale)
  assert q.dtype == np.int8 and scale.dtype == np.float32
  assert scale.shape == tuple(n for i, n in enumerate(shape) if i not in contracted)
  assert np.abs(q.astype(int)).max() <= 127 and (q != -128).all()
  # Each non-zero channel's largest weight lands on ±127: the whole int8 range is used.
  channel_max = np.abs(q.astype(int)).max(axis=tuple(contracted))
  assert (channel_max[scale != 1] == 127).all()
  restored = np.asarray(quantize.dequantize(jnp.asarray(q), jnp.asarray(scale), axes))
  # Round to nearest: |w − q·scale| ≤ scale / 2, up to float32 rounding of q·scale (≤ 127·scale·2⁻²⁴).
  bound = np.expand_dims(scale, tuple(sorted(axes))) * (0.5 + 1e-5)
  assert (np.abs(restored - w) <= bound).all(), np.max(np.abs(restored - w) / bound)
  assert (scale[(0,) * scale.ndim] == 1.0) and (restored[zero_channel] == 0).all() and (q[zero_channel] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# The int8 model's structure

# The scales' logical axes as the design fixes them (the weight's output axes), which the sharding rules map.
SCALE_AXES = {
  "wq_scale": ("heads", "head_dim"),
  "wk_scale": ("kv_heads", "head_dim"),
  "wv_scale": ("kv_heads", "head_dim"),
  "wo_scale": ("embed",),
  "w_gate_scale": ("mlp",),
  "w_up_scale": ("mlp",),
  "w_down_scale": ("embed",),
  "lm_head_scale": ("vocab",),
  "embed_scale": ("vocab",),
}


def shapes(tree) -> dict:
  return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_quantize_params_gives_the_int8_models_structure(tied, stacked):
  cfg = small_config(tie_embeddings=tied, param_dtype="bfloat16")
  float_params = abstract_params(cfg)
  prepare = (lambda p: p) if stacked else layer_layout.unstack_layers
  int8_cfg, _ = quantize.quantize_params({}, cfg)
  assert int8_cfg == cfg.replace(quantize="int8")
  got = jax.eval_shape(lambda p: quantize.quantize_params(prepare(p), cfg)[1], float_params)
  expected = abstract_params(int8_cfg, stacked)
  assert shapes(got) == shapes(expected)
  dtypes = {
    path[-1].key: leaf[1]
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes(got), is_leaf=tuple.__instancecheck__)
  }
  assert {dtypes[n] for n in quantize.INT8_CONTRACT_AXES if n in dtypes} == {"int8"}
  assert {dtypes[n] for n in SCALE_AXES if n in dtypes} == {"float32"}
  assert dtypes["scale"] == "bfloat16"  # norm scales stay in param_dtype

  state = nnx.state(nnx.eval_shape(lambda: model_lib.Llama(int8_cfg, rngs=nnx.Rngs(0), stacked_layers=stacked)))
  for path, variable in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    name = path[-1].key
    if name not in SCALE_AXES:
      continue
    axes = variable.get_metadata()["out_sharding"]
    stacked_axis = ("layers",) if stacked and path[0].key == "layers" else ()
    expected_axes = (*stacked_axis, *SCALE_AXES[name])
    assert axes == expected_axes, (jax.tree_util.keystr(path), axes)
    assert len(variable.shape) == len(axes)


def test_weight_bytes_count_int8_weights_and_float32_scales():
  cfg = small_config()
  float_params, int8_params = abstract_params(cfg), abstract_params(cfg.replace(quantize="int8"))
  assert quantize.weight_bytes(float_params) == cfg.num_params() * 4
  scales = sum(
    int(np.prod(a.shape)) for p, a in jax.tree_util.tree_leaves_with_path(int8_params) if p[-1].key.endswith("_scale")
  )
  norms = 2 * cfg.n_layers * cfg.dim + cfg.dim
  assert quantize.weight_bytes(int8_params) == (cfg.num_params() - norms) + norms * 4 + scales * 4
  # On one device every byte is on it; numpy leaves (no sharding) count whole.
  arrays = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), int8_params)
  assert per_device_bytes(arrays) == quantize.weight_bytes(int8_params)
  assert per_device_bytes(jax.tree.map(np.asarray, arrays)) == quantize.weight_bytes(int8_params)


class FakeLeaf:
  """An array sharded over several devices (this process has one): each device in `devices` holds a shard of
  `shard_shape`. What inference.per_device_bytes reads: shape, dtype and the sharding's shard_shape and devices."""

  def __init__(self, shape, dtype, devices, shard_shape):
    self.shape, self.dtype, self.sharding = shape, dtype, self
    self.addressable_devices, self._shard_shape = devices, shard_shape

  def shard_shape(self, shape):
    return self._shard_shape


def test_per_device_bytes_is_the_fullest_device():
  leaves = [
    np.zeros((8, 4), np.int8),  # no sharding: 32 bytes on every device
    FakeLeaf((8, 4), np.float32, ["device a", "device b"], (4, 4)),  # split in two: 64 bytes each
    FakeLeaf((8,), np.float32, ["device b"], (8,)),  # 32 bytes on b only
  ]
  assert quantize.weight_bytes(leaves) == 32 + 128 + 32
  assert per_device_bytes(leaves) == 32 + 64 + 32


def test_quantize_params_places_each_leaf_in_the_given_shardings_and_can_free_the_floats():
  from llama_jax.core.run_config import DEFAULT_LOGICAL_AXIS_RULES
  from llama_jax.model import sharding

  cfg = small_config()
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  _, targets = sharding.abstract_params(model_lib.Llama, cfg.replace(quantize="int8"), mesh, DEFAULT_LOGICAL_AXIS_RULES)
  shardings = sharding.shardings_of(targets)
  # The scales follow their weights' output axes through the rules (layers → None, heads → tensor, embed → fsdp ...).
  assert shardings["layers"]["attention"]["wq_scale"].spec == PartitionSpec(None, "tensor", None)
  assert shardings["layers"]["attention"]["wo_scale"].spec == PartitionSpec(None, "fsdp")
  assert shardings["embed_scale"].spec == shardings["lm_head_scale"].spec == PartitionSpec("tensor")
  params = jax.tree.map(jnp.asarray, random_params(cfg, seed=5))
  leaves = jax.tree.leaves(params)
  _, int8_params = quantize.quantize_params(params, cfg, shardings, donate=True)
  jax.tree.map(lambda a, s: (a.sharding == s) or pytest.fail(f"{a.sharding} != {s}"), int8_params, shardings)
  weights = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if path[-1].key != "scale"]
  assert all(w.is_deleted() for w in weights) and len(weights) == len(leaves) - 3
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(int8_params))


# ---------------------------------------------------------------------------------------------------------------------
# The int8 model's numbers


def test_int8_logits_are_close_to_float32_in_both_layouts():
  cfg = small_config()
  params = random_params(cfg, seed=1)
  int8_cfg, int8_params = quantize.quantize_params(params, cfg)
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 12))
  reference = forward(cfg, params, tokens)
  stacked = forward(int8_cfg, int8_params, tokens)
  decoded = cached_decode(int8_cfg, int8_params, tokens, prefill=8)
  error = np.abs(stacked - reference).max()
  relative_rms = np.sqrt(np.mean((stacked - reference) ** 2) / np.mean(reference**2))
  print(f"int8 vs float32: max |logit| {np.abs(reference).max():.2f}, max abs diff {error:.2e}, rms {relative_rms:.2%}")
  assert relative_rms <= RANDOM_TOL
  assert error > 1e-3  # the weights really were rounded
  # Both layouts run the same int8 math: the cached decode equals the scanned forward to float32 rounding.
  np.testing.assert_allclose(decoded, stacked, atol=1e-5, rtol=0)


def exactly_representable_params(cfg: ModelConfig, seed: int) -> tuple[dict, dict]:
  """(float32 params, their int8 q per weight) where each weight is q · scale, q a random int8 with ±127 in every
  channel: quantizing them gives back q exactly, so the int8 model must equal the float one to rounding."""
  rng = np.random.RandomState(seed)
  q_tree = {}

  def one(path, leaf):
    name = path[-1].key
    if name == "scale":
      return (1 + 0.1 * rng.randn(*leaf.shape)).astype(np.float32)
    contracted = {a % leaf.ndim for a in quantize.INT8_CONTRACT_AXES[name]}
    q = rng.randint(-127, 128, leaf.shape).astype(np.int8)
    first_input = tuple(0 if i in contracted else slice(None) for i in range(leaf.ndim))
    q[first_input] = np.where(rng.rand(*q[first_input].shape) < 0.5, -127, 127)  # every channel reaches ±127
    scale_shape = tuple(1 if i in contracted else n for i, n in enumerate(leaf.shape))
    scale = (0.1 / 127 * np.exp(0.5 * rng.randn(*scale_shape))).astype(np.float32)
    q_tree[jax.tree_util.keystr(path)] = q
    return q.astype(np.float32) * scale

  return jax.tree_util.tree_map_with_path(one, abstract_params(cfg)), q_tree


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int8_model_with_exactly_representable_weights_equals_the_float_model(tied):
  """The sharp test of the dequantization: which axis each scale belongs to, applied to the output of each site
  (the decoding layout runs the same sites: it equals this layout's int8 logits, test above)."""
  cfg = small_config(tie_embeddings=tied)
  params, q_tree = exactly_representable_params(cfg, seed=3)
  int8_cfg, int8_params = quantize.quantize_params(params, cfg)
  for path, q in jax.tree_util.tree_leaves_with_path(int8_params):
    if jax.tree_util.keystr(path) in q_tree:
      np.testing.assert_array_equal(np.asarray(q), q_tree[jax.tree_util.keystr(path)])
  tokens = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 12))
  reference = forward(cfg, params, tokens)
  stacked = forward(int8_cfg, int8_params, tokens)
  print(f"exact int8: max |logit| {np.abs(reference).max():.2f}, max abs diff {np.abs(stacked - reference).max():.2e}")
  np.testing.assert_allclose(stacked, reference, atol=EXACT_TOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Config


def test_model_config_quantize_is_a_checked_choice_that_round_trips(tmp_path):
  from llama_jax.checkpoint import params as checkpoint_params
  from llama_jax.core import paths

  cfg = small_config(quantize="int8")
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
  # A checkpoint written before the field existed: its config has no "quantize", and reads as a float model.
  saved_before_the_field = {k: v for k, v in small_config().to_dict().items() if k != "quantize"}
  (tmp_path / paths.CONFIG_FILE).write_text(json.dumps(saved_before_the_field))
  assert checkpoint_params.read_model_config(str(tmp_path)) == small_config()
  with pytest.raises(ConfigError, match=r"^quantize must be one of none, int8; got 'int4'$"):
    small_config(quantize="int4")


def test_run_config_refuses_to_train_an_int8_model():
  with pytest.raises(ConfigError) as error:
    RunConfig.from_dict(dict(model=dict(quantize="int8")))
  assert str(error.value) == (
    "model.quantize is for decoding (sample/evaluate --quantize int8); training needs float weights"
  )


def test_quantize_params_refuses_int8_params():
  with pytest.raises(quantize.QuantizeError, match="already quantized"):
    quantize.quantize_params({}, small_config(quantize="int8"))


# ---------------------------------------------------------------------------------------------------------------------
# A trained model: loss and greedy text with int8 weights

# Trained for real (the train step, AdamW, warmup + cosine) for a few seconds: 200 steps of 8 × 64 tokens of two plays
# reach a validation loss of ~3.7 nats on a third, with 512 tokens. A model trained further agrees more often
# (300 steps of 16 × 64: 100% of the greedy tokens), a less trained one less: its top two tokens are often close.
TRAINED = dict(vocab_size=512, ffn_hidden_dim=None, multiple_of=32)


def token_stream(tokenizer_path: str, sources: list[str]) -> np.ndarray:
  from llama_jax.data import sources as sources_lib
  from llama_jax.data import text
  from llama_jax.data.tokenization import Tokenizer

  return text.tokenize_documents(sources_lib.resolve_sources(sources), Tokenizer(tokenizer_path))


def train_tiny_model(cfg: ModelConfig, tokens: np.ndarray, steps: int, seq_len: int, batch: int) -> dict:
  """`steps` steps of the real train step and optimizer on random windows of `tokens`; the stacked float32 params."""
  from llama_jax.core.run_config import TrainConfig
  from llama_jax.training import optimizer
  from llama_jax.training import step as step_lib

  train_cfg = TrainConfig(steps=steps, lr=3e-3, warmup_steps=steps // 10, batch_size=batch, seq_len=seq_len)
  tx, schedule = optimizer.make_optimizer(train_cfg), optimizer.learning_rate_schedule(train_cfg)
  params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_lib.Llama(cfg, rngs=nnx.Rngs(0)))))()
  state = dict(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.key_data(jax.random.key(0))
  )
  step_fn = jax.jit(
    functools.partial(
      step_lib.train_step,
      objective=step_lib.make_objective(graphdef_of(cfg), None),
      count_name="tokens",
      tx=tx,
      schedule=schedule,
      grad_accum=1,
    ),
    donate_argnums=0,
  )
  rng = np.random.RandomState(0)
  for _ in range(steps):
    starts = rng.randint(0, len(tokens) - seq_len - 1, batch)
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    state, metrics = step_fn(state, dict(inputs=jnp.asarray(windows[:, :-1]), targets=jnp.asarray(windows[:, 1:])))
  print(f"trained {steps} steps: last training loss {float(metrics['loss']):.3f}")
  return state["params"]


def loss_and_predictions(cfg: ModelConfig, params: dict, windows: np.ndarray) -> tuple[float, np.ndarray]:
  """(mean next-token cross-entropy over the windows, the model's top token at each position), from one forward."""
  logits = forward(cfg, params, windows[:, :-1]).astype(np.float64)
  top = logits.max(-1, keepdims=True)
  log_normalizer = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  target_logits = np.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
  return float(np.mean(log_normalizer - target_logits)), logits.argmax(-1)


@needs_shakespeare
def test_trained_tiny_model_keeps_its_loss_and_greedy_text_with_int8_weights(small_tokenizer):
  """Trained on two plays, validated on a third: int8 weights keep the validation loss within 1%, the top token at
  nearly every position of the text, and most greedy tokens generated through the sampler (whose decoding layout and
  per-layer cache take the int8 config and tree unchanged)."""
  from llama_jax.inference.sampler import Sampler

  start = time.time()
  cfg = small_config(**TRAINED)
  train_tokens = token_stream(small_tokenizer, ["shakespeare:sonnets,comedy_of_errors"])
  val_tokens = token_stream(small_tokenizer, ["shakespeare:lovers_complaint"])
  params = train_tiny_model(cfg, train_tokens, steps=200, seq_len=64, batch=8)
  trained = time.time()

  seq_len = 64
  n_windows = (len(val_tokens) - 1) // seq_len
  windows = np.stack([val_tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)])
  int8_cfg, int8_params = quantize.quantize_params(params, cfg)
  float_loss, float_top = loss_and_predictions(cfg, params, windows)
  int8_loss, int8_top = loss_and_predictions(int8_cfg, int8_params, windows)
  relative = (int8_loss - float_loss) / float_loss
  top_agreement = (float_top == int8_top).mean()

  prompts = [windows[i, :16].tolist() for i in range(0, n_windows, n_windows // 16)][:16]
  new_tokens = 32
  # eos -1: no row stops, so the rows of both models compare position by position.
  float_text = Sampler(cfg, params, eos_id=-1, pad_id=0).generate(prompts, new_tokens)
  int8_text = Sampler(int8_cfg, int8_params, eos_id=-1, pad_id=0).generate(prompts, new_tokens)
  same = np.asarray(float_text) == np.asarray(int8_text)
  greedy_agreement = same.mean()
  # Tokens before each row's first difference (after it the two models continue different texts).
  before_first_difference = np.mean([np.argmin(row) if not row.all() else len(row) for row in same])
  bytes_float, bytes_int8 = quantize.weight_bytes(params), quantize.weight_bytes(int8_params)
  print(
    f"validation loss over {windows.size - n_windows} tokens: float32 {float_loss:.4f}, int8 {int8_loss:.4f} "
    f"({relative:+.2e} relative); same top token at {top_agreement:.1%} of them; greedy agreement "
    f"{greedy_agreement:.1%} of {same.size} tokens ({len(prompts)} prompts × {new_tokens}), "
    f"{before_first_difference:.1f} tokens before the first difference on average; "
    f"weights {bytes_float:,} → {bytes_int8:,} bytes; "
    f"train {trained - start:.1f} s, the rest {time.time() - trained:.1f} s"
  )
  assert abs(relative) <= 0.01
  assert top_agreement >= 0.97
  assert greedy_agreement >= 0.6
