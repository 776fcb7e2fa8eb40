"""The attention dispatch: kernel selection by backend and shape, and every kernel against the XLA reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import attention


def random_qkv(batch=2, length=128, n_heads=4, n_kv_heads=2, head_dim=64, seed=0):
  rng = np.random.RandomState(seed)
  q = rng.randn(batch, length, n_heads, head_dim).astype(np.float32)
  k = rng.randn(batch, length, n_kv_heads, head_dim).astype(np.float32)
  v = rng.randn(batch, length, n_kv_heads, head_dim).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def choose(requested, backend, **overrides):
  shapes = dict(q_len=256, kv_len=256, head_dim=128, dtype=jnp.bfloat16, has_segment_ids=False, has_positions=False)
  shapes.update(overrides)
  return attention.choose_implementation(requested, backend, **shapes)


def test_selection_by_backend():
  assert choose("auto", "cpu") == "chunked"
  assert choose("auto", "gpu") == "cudnn"
  assert choose("auto", "tpu") == "splash"
  assert choose("xla", "gpu") == "xla" and choose("xla", "tpu") == "xla"


def test_accelerator_kernels_fall_back_to_xla_where_they_do_not_apply():
  assert choose("cudnn", "cpu") == "chunked"  # explicit request on the wrong backend never breaks CPU
  assert choose("splash", "cpu", q_len=100, kv_len=100) == "xla"
  assert choose("auto", "gpu", dtype=jnp.float32) == "chunked"  # cudnn flash attention is half precision only
  assert choose("auto", "gpu", head_dim=256) == "chunked"
  assert choose("auto", "gpu", has_segment_ids=True) == "chunked"
  assert choose("auto", "tpu", q_len=100, kv_len=100) == "xla"  # splash tiles by 128; 100 is no whole chunk count
  assert choose("auto", "tpu", has_positions=True) == "xla"  # decoding against a cache: positional mask
  assert choose("auto", "gpu", has_positions=True) == "xla"
  with pytest.raises(ValueError, match="attention implementation must be one of"):
    choose("flash", "cpu")


def test_chunked_attention_where_the_length_splits_into_chunks():
  assert [attention.chunk_size(n) for n in (64, 128, 512, 1024, 2048, 4096, 100, 4000)] == [
    None,
    64,
    64,
    64,
    128,
    256,
    None,
    None,
  ]
  assert choose("auto", "cpu", q_len=4096, kv_len=4096) == "chunked"
  assert choose("auto", "tpu", q_len=4096, kv_len=4096) == "splash"
  assert choose("chunked", "cpu", q_len=64, kv_len=64) == "xla"  # one chunk: nothing to split
  assert choose("auto", "cpu", q_len=4000, kv_len=4000) == "xla"  # not a whole number of chunks
  assert choose("auto", "cpu", q_len=4096, kv_len=4096, has_positions=True) == "xla"


def reference_attention(q, k, v, segment_ids=None):
  """Repeats kv heads (the textbook form) to check the grouped einsum that avoids the copy."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  scores = jnp.where(mask, scores, -jnp.inf)
  return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores, -1), v)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_xla_grouped_attention_equals_repeated_kv_heads(n_kv_heads):
  q, k, v = random_qkv(length=32, n_kv_heads=n_kv_heads)
  np.testing.assert_allclose(attention.xla_attention(q, k, v), reference_attention(q, k, v), atol=1e-5)


def test_positional_mask_equals_index_causal_mask_for_self_attention():
  q, k, v = random_qkv(length=32)
  positions = jnp.broadcast_to(jnp.arange(32) + 11, (2, 32))
  np.testing.assert_allclose(
    attention.xla_attention(q, k, v, q_positions=positions, kv_positions=positions),
    attention.xla_attention(q, k, v),
    atol=1e-6,
  )


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cached_attention_over_a_k_s_h_cache_equals_the_positional_xla_kernel(n_kv_heads):
  q, k, v = random_qkv(length=24, n_kv_heads=n_kv_heads)
  q = q[:, :3]  # three new tokens against 24 slots, some of them empty (position far in the future)
  q_positions = jnp.asarray([[10, 11, 12], [5, 6, 7]])
  kv_positions = jnp.asarray([list(range(13)) + [2**30] * 11, list(range(8)) + [2**30] * 16])
  expected = attention.xla_attention(q, k, v, q_positions=q_positions, kv_positions=kv_positions)
  got = attention.cached_attention(
    q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_positions=q_positions, kv_positions=kv_positions
  )
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_fully_masked_padding_rows_stay_finite():
  q, k, v = random_qkv(length=16)
  segment_ids = jnp.asarray([[1] * 8 + [0] * 8, [1] * 16])
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  out = attention.xla_attention(
    q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, q_positions=positions, kv_positions=positions - 100
  )
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("remat", [False, True])
def test_chunked_attention_equals_xla_forward_and_backward_with_segments(remat):
  q, k, v = random_qkv(length=64, head_dim=16)
  segment_ids = jnp.asarray([[1] * 40 + [2] * 20 + [0] * 4, [1] * 64])

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

  def chunked(q, k, v):
    return attention.chunked_attention(q, k, v, segment_ids=segment_ids, chunk=16, remat=remat)

  def xla(q, k, v):
    return attention.xla_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)

  np.testing.assert_allclose(chunked(q, k, v), xla(q, k, v), atol=1e-6)
  for a, b in zip(jax.grad(loss(chunked), (0, 1, 2))(q, k, v), jax.grad(loss(xla), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_splash_kernel_in_interpret_mode_equals_xla_with_segments():
  """The TPU kernel's wrapper (scaling, GQA grouping, segment ids, layouts), run by the Pallas interpreter on CPU."""
  q, k, v = random_qkv(batch=1, length=128, n_heads=4, n_kv_heads=2, head_dim=64)
  segment_ids = jnp.asarray([[1] * 50 + [2] * 78])
  out = attention.splash_attention(q, k, v, segment_ids=segment_ids, interpret=True)
  expected = reference_attention(q, k, v, segment_ids)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5)
