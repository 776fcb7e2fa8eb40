"""The loss computed in chunks of the sequence (`model.loss_chunk`) against the whole-sequence loss it replaces: the
same per-token losses and gradients (float32, to 1e-6 relative; the head's matmul over fewer rows may round
differently), with and without a tied head, for a chunk that does not divide the length (the last one padded), with
packed segments, loss weights and a LoRA model, and through one real train step; and the compiled step's temporaries
shrink (the [B, T, V] logits are gone)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import LoraConfig
from llama_jax.model.llama import Llama
from llama_jax.model.loss import token_losses

CFG = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128)


def batch(seed=0, batch_size=2, length=48):
  rs = np.random.RandomState(seed)
  tokens = rs.randint(0, CFG.vocab_size, (batch_size, length + 1))
  segments = np.ones((batch_size, length), np.int32)
  segments[0, 20:] = 2  # two packed documents in row 0
  positions = np.where(segments == 2, np.arange(length) - 20, np.arange(length))
  return dict(
    inputs=jnp.asarray(tokens[:, :-1]),
    targets=jnp.asarray(tokens[:, 1:]),
    positions=jnp.asarray(positions, jnp.int32),
    segment_ids=jnp.asarray(segments),
    weights=jnp.asarray(rs.rand(batch_size, length) < 0.8, jnp.float32),
  )


def loss_and_grads(cfg, params, data, lora=None):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), lora=lora)))

  def mean_loss(p):
    losses, weights = token_losses(p, graphdef, data)
    return jnp.sum(losses * weights) / jnp.sum(weights), losses

  (loss, losses), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)
  return float(loss), np.asarray(losses), grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
  "chunk, head_once",
  [(16, "none"), (20, "none"), (48, "none"), (20, "weights"), (20, "weights_and_gradient")],
  ids=["divides", "last_chunk_padded", "one_chunk", "head_once", "head_and_gradient_once"],
)
def test_chunked_losses_and_gradients_equal_the_whole_sequence_loss(tied, chunk, head_once):
  cfg = CFG.replace(tie_embeddings=tied)
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(3))))
  data = batch()
  whole_loss, whole_losses, whole_grads = loss_and_grads(cfg, params, data)
  loss, losses, grads = loss_and_grads(cfg.replace(loss_chunk=chunk, loss_head_once=head_once), params, data)
  np.testing.assert_allclose(losses, whole_losses, rtol=1e-6, atol=0)
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
  assert_same_grads(grads, whole_grads)


def assert_same_grads(grads, expected):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_a_lora_model_gets_the_same_gradients_with_chunks():
  """LoRA (every projection, adapters randomised so their gradients are not trivially zero): the chunked loss
  reads the same hidden states, so adapter and base gradients are the whole loss's."""
  lora = LoraConfig(rank=4, alpha=8.0)
  model = Llama(CFG, rngs=nnx.Rngs(5), lora=lora)
  params = jax.tree.map(
    lambda a: a + 0.02 * np.random.RandomState(a.size % 97).randn(*a.shape).astype(a.dtype),
    nnx.to_pure_dict(nnx.state(model)),
  )
  data = batch(seed=1)
  whole_loss, whole_losses, whole_grads = loss_and_grads(CFG, params, data, lora)
  loss, losses, grads = loss_and_grads(CFG.replace(loss_chunk=16), params, data, lora)
  np.testing.assert_allclose(losses, whole_losses, rtol=1e-6, atol=0)
  assert_same_grads(grads, whole_grads)


def test_the_chunked_step_holds_no_whole_sequence_logits():
  """Compiled on CPU, the gradient of the chunked loss needs fewer temporary bytes than the whole one by at least
  the [B, T, V] float32 logits less one chunk's (measured: 1.63 times the logits, 13.7 of 8.4 MB: their gradient
  goes too, partly fused away in the whole loss already)."""
  cfg = CFG.replace(vocab_size=8192)
  params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))))
  rs = np.random.RandomState(0)
  data = dict(inputs=jnp.asarray(rs.randint(0, 8192, (2, 128))), targets=jnp.asarray(rs.randint(0, 8192, (2, 128))))

  def temporaries(c):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(c, rngs=nnx.Rngs(0))))
    grad = jax.jit(jax.grad(lambda p: jnp.mean(token_losses(p, graphdef, data)[0])))
    return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = 2 * 128 * 8192 * 4
  saved = temporaries(cfg) - temporaries(cfg.replace(loss_chunk=16))
  assert saved >= logits_bytes * (1 - 16 / 128), (saved, logits_bytes)
