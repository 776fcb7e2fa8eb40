"""Norm variants (``model.norm`` rmsnorm | layernorm | none, ``model.norm_position`` pre | post) against a small torch
reference, decoding, training, their config checks, checkpoints and the HF conversion that must refuse them.

The references are HF transformers' own Llama attention and MLP with the norms placed by hand: torch's LayerNorm
without bias, HF's LlamaRMSNorm, or none; pre-norm h = x + f(norm(x)), post-norm h = norm(x + f(x)). Tolerance 1e-5
as in test_model.py (float32, different summation order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from llama_jax import convert as convert_lib
from llama_jax.checkpoint import digests, train_state
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core import paths
from llama_jax.core.checks import ConfigError
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import TrainConfig
from llama_jax.interop import hf, output
from llama_jax.model import layer_layout
from llama_jax.model import llama as model_lib
from llama_jax.model.loss import token_losses
from llama_jax.training.optimizer import make_optimizer
from tests import hf_utils
from tests.model.test_llama import causal_mask, hf_rope, load, random_hidden, small_config

torch.set_num_threads(2)
TOL = 1e-5
VARIANTS = {
  "layernorm_pre": dict(norm="layernorm"),
  "layernorm_post": dict(norm="layernorm", norm_position="post"),
  "rmsnorm_post": dict(norm_position="post"),
  "none": dict(norm="none"),
}


def variant_params(base_params: dict, cfg: ModelConfig) -> dict:
  """HF-converted params of the LLaMA layout, cut to what `cfg`'s variant holds (no norms, no final norm)."""
  params = dict(base_params, layers=dict(base_params["layers"]))
  if cfg.norm == "none":
    del params["layers"]["attention_norm"], params["layers"]["mlp_norm"]
  if cfg.norm == "none" or cfg.norm_position == "post":
    del params["final_norm"]
  return params


def torch_norm(cfg: ModelConfig, hf_rmsnorm):
  """The reference norm of a variant, with the scale of the HF RMSNorm it replaces."""
  if cfg.norm == "none":
    return lambda x: x
  if cfg.norm == "rmsnorm":
    return hf_rmsnorm
  layer_norm = torch.nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=False)
  with torch.no_grad():
    layer_norm.weight.copy_(hf_rmsnorm.weight)
  return layer_norm


def torch_block(cfg, hf_layer, x_t, position_embeddings):
  attention_norm = torch_norm(cfg, hf_layer.input_layernorm)
  mlp_norm = torch_norm(cfg, hf_layer.post_attention_layernorm)
  mask = causal_mask(x_t.shape[1])

  def attend(h):
    return hf_layer.self_attn(h, position_embeddings=position_embeddings, attention_mask=mask)[0]

  if cfg.norm_position == "pre":
    h = x_t + attend(attention_norm(x_t))
    return h + hf_layer.mlp(mlp_norm(h))
  h = attention_norm(x_t + attend(x_t))
  return mlp_norm(h + hf_layer.mlp(h))


def test_layernorm_without_bias_matches_torch():
  cfg = small_config(norm="layernorm")
  reference = torch.nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=False)
  with torch.no_grad():
    reference.weight.copy_(1 + 0.1 * torch.randn(cfg.dim))
  ours = load(model_lib.LayerNorm(cfg, rngs=nnx.Rngs(0)), {"scale": reference.weight.detach().numpy()})
  x = random_hidden(cfg) * 3 + 1.5  # an offset, which layernorm removes and rmsnorm does not
  got = np.asarray(ours(jnp.asarray(x)))
  np.testing.assert_allclose(got, reference(torch.tensor(x)).detach().numpy(), atol=TOL, rtol=0)
  assert sorted(nnx.to_pure_dict(nnx.state(ours))) == ["scale"]  # no bias parameter


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_variant_matches_torch_reference(variant):
  base = small_config(n_kv_heads=2)
  cfg = base.replace(**VARIANTS[variant])
  hf_model = hf_utils.random_hf_model(base)
  layer0 = jax.tree.map(lambda a: a[0], variant_params(hf_utils.params_of(hf_model, base), cfg)["layers"])
  ours = load(nnx.eval_shape(lambda: model_lib.Block(cfg, rngs=nnx.Rngs(0))), layer0)
  x = random_hidden(cfg, length=20)
  positions = np.broadcast_to(np.arange(20), (2, 20))
  expected = torch_block(cfg, hf_model.model.layers[0], torch.tensor(x), hf_rope(hf_model, torch.tensor(x), positions))
  got = np.asarray(ours(jnp.asarray(x), jnp.asarray(positions), None)[0])
  np.testing.assert_allclose(got, expected.detach().numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_variant_matches_torch_reference_and_decodes_like_its_forward(variant):
  base = small_config(n_kv_heads=2)
  cfg = base.replace(**VARIANTS[variant])
  hf_model = hf_utils.random_hf_model(base)
  params = variant_params(hf_utils.params_of(hf_model, base), cfg)
  ours = load(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))), params)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
  with torch.no_grad():
    x_t = hf_model.model.embed_tokens(torch.tensor(tokens))
    position_embeddings = hf_rope(hf_model, x_t, np.broadcast_to(np.arange(24), (2, 24)))
    for hf_layer in hf_model.model.layers:
      x_t = torch_block(cfg, hf_layer, x_t, position_embeddings)
    if cfg.norm_position == "pre":  # post-norm models have no final norm (their stream is normalised already)
      x_t = torch_norm(cfg, hf_model.model.norm)(x_t)
    expected = hf_model.lm_head(x_t).numpy()
  logits = np.asarray(ours(jnp.asarray(tokens)))
  np.testing.assert_allclose(logits, expected, atol=TOL, rtol=0)

  # The KV-cache path (Block.decode) in the sampler's layout: a prefill of 20 tokens, then 4 one at a time. The
  # stacked layout shares Block.decode; only its cache bookkeeping differs, which no norm touches (test_sample.py).
  unstacked = load(
    nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), stacked_layers=False)),
    layer_layout.unstack_layers(params),
  )
  cache = model_lib.KVCache.empty(cfg, 2, 32, per_layer=True)
  decoded, cache = unstacked.decode(jnp.asarray(tokens[:, :20]), None, cache)
  steps = [decoded]
  for t in range(20, 24):
    step_logits, cache = unstacked.decode(jnp.asarray(tokens[:, t : t + 1]), None, cache)
    steps.append(step_logits)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_few_dozen_steps_of_each_variant_lower_the_loss(variant):
  cfg = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=2, multiple_of=16, max_seq_len=32, scan_layers=False, **VARIANTS[variant]
  )
  graphdef, params = nnx.split(model_lib.Llama(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  tx = make_optimizer(TrainConfig(lr=1e-2, warmup_steps=0, steps=30))
  rng = np.random.RandomState(1)
  window = rng.randint(0, cfg.vocab_size, (4, 17))
  batch = {"inputs": jnp.asarray(window[:, :-1]), "targets": jnp.asarray(window[:, 1:])}

  @jax.jit
  def step(params, opt_state):
    def mean_loss(p):
      losses, _ = token_losses(p, graphdef, batch)
      return jnp.mean(losses)

    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  losses = []
  for _ in range(30):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < losses[0] - 1.0, f"{variant}: loss {losses[0]:.3f} → {losses[-1]:.3f}"


@pytest.mark.parametrize("variant", ["rmsnorm_pre", *VARIANTS])
def test_num_params_counts_each_variants_parameters(variant):
  cfg = small_config(tie_embeddings=variant == "none", **VARIANTS.get(variant, {}))
  _, abstract = model_lib.sharding.abstract_params(model_lib.Llama, cfg)
  assert sum(a.size for a in jax.tree.leaves(abstract)) == cfg.num_params()


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(norm="batchnorm"), "norm must be one of rmsnorm, layernorm, none; got 'batchnorm'"),
    (dict(norm_position="middle"), "norm_position must be one of pre, post; got 'middle'"),
    (dict(norm="none", norm_position="post"), "norm_position 'post' normalises each residual sum, but norm is 'none'"),
  ],
)
def test_bad_norm_settings_are_one_line_config_errors(changes, message):
  with pytest.raises(ConfigError) as error:
    small_config(**changes)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_model_configs_saved_before_the_norm_fields_read_as_llamas(tmp_path):
  saved = small_config().to_dict()
  del saved["norm"], saved["norm_position"]
  (tmp_path / paths.CONFIG_FILE).write_text(__import__("json").dumps(saved))
  cfg = checkpoint_params.read_model_config(str(tmp_path))
  assert (cfg.norm, cfg.norm_position) == ("rmsnorm", "pre")
  assert ModelConfig.from_dict(small_config(norm="layernorm").to_dict()).norm == "layernorm"  # recorded, read back


@pytest.fixture(scope="module")
def post_norm_checkpoint(tmp_path_factory):
  cfg = small_config(norm="layernorm", norm_position="post", n_layers=1)
  directory = str(tmp_path_factory.mktemp("post") / "ckpt")
  _, abstract = model_lib.sharding.abstract_params(model_lib.Llama, cfg)
  checkpoint_params.save_params_dir(directory, cfg, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract))
  return directory, cfg


def test_a_workdir_of_another_norm_variant_is_refused(post_norm_checkpoint):
  directory, cfg = post_norm_checkpoint
  checkpointer = train_state.TrainCheckpointer(directory, async_save=False)
  try:
    checkpointer.check_compatible(cfg)  # the same variant: accepted
    with pytest.raises(digests.CheckpointError, match="norm_position post → pre"):
      checkpointer.check_compatible(cfg.replace(norm_position="pre"))
  finally:
    checkpointer.close()
  assert checkpoint_params.read_model_config(directory) == cfg  # the fields are recorded in model_config.json


def test_hf_conversion_of_a_variant_is_refused_in_one_line(post_norm_checkpoint, tmp_path, capsys):
  directory, cfg = post_norm_checkpoint
  out = tmp_path / "hf"
  with pytest.raises(SystemExit) as exit_info:
    convert_lib.main(["--to_hf", directory, "--out", str(out)])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "norm='layernorm', norm_position='post'" in err and "HF Llama" in err, err
  assert not out.exists()
  with pytest.raises(output.ConvertError, match="norm='none'"):
    hf.hf_tensor_plan(small_config(norm="none"))  # the library path refuses too
