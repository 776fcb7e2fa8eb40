"""The attention dispatch: kernel selection by backend and shape, and every kernel against the XLA reference."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.model import attention


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


def float64_causal_attention(q, k, v):
  """The exact answer for the given (possibly bf16-rounded) inputs: float64 numpy, kv heads repeated."""
  q, k, v = (np.asarray(a).astype(np.float64) for a in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  scores = np.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("BNTS,BSNH->BTNH", probs / probs.sum(-1, keepdims=True), v)


BF16_KERNELS = {
  "xla": lambda q, k, v: attention.xla_attention(q, k, v),
  "chunked": lambda q, k, v: attention.chunked_attention(q, k, v, remat=False),
  "chunked_remat": lambda q, k, v: attention.chunked_attention(q, k, v, remat=True),
  "cached": lambda q, k, v: attention.cached_attention(
    q,
    k.transpose(0, 2, 1, 3),
    v.transpose(0, 2, 1, 3),
    q_positions=jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2]),
    kv_positions=jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2]),
  ),
}


@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_bf16_attention_keeps_scores_and_softmax_in_float32(kernel):
  """With bf16 q, k, v every XLA kernel computes q·k and the softmax in float32 (model guide: "attention scores and
  softmax ... are float32 whatever the compute dtype"); only the probabilities fed to the ·v product and the output
  are rounded to bf16.

  q and k are scaled so the unscaled scores are ~±64..200, where a bf16 score (8 mantissa bits) is off by up to 0.5:
  after the 1/√H scaling that moves each softmax logit by ~0.1 and the output by ~0.19 (measured with the float32
  island removed). With float32 scores the only errors are the bf16 roundings of the probabilities and of the output
  (2⁻⁹ relative each, |v| ≤ ~4): measured 0.013, so 0.03 separates the two by 5×.
  """
  q, k, v = random_qkv(length=128, head_dim=16, seed=3)
  q, k, v = (4 * q).astype(jnp.bfloat16), (4 * k).astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  out = BF16_KERNELS[kernel](q, k, v)
  assert out.dtype == jnp.bfloat16  # the compute dtype comes back: the island is internal
  error = np.abs(np.asarray(out, np.float64) - float64_causal_attention(q, k, v)).max()
  assert error < 0.03, f"{kernel}: max error {error:.3f} vs float64; scores or softmax were not float32"


@pytest.mark.parametrize(
  "requested,length,segments,fallback",
  [("cudnn", 128, False, "chunked"), ("splash", 128, True, "chunked"), ("splash", 100, False, "xla")],
  ids=["cudnn_cpu", "splash_cpu_packed", "splash_ragged"],
)
def test_explicit_accelerator_kernel_on_cpu_warns_and_falls_back_with_equal_numbers(
  caplog, requested, length, segments, fallback
):
  """Model guide: "An explicit cudnn/splash that does not apply falls back with a warning, so every config also runs on
  CPU". The fallback is one of the exact XLA kernels, so it equals the whole-scores reference to rounding (1e-6)."""
  q, k, v = random_qkv(length=length, head_dim=16)
  segment_ids = jnp.asarray([[1] * 50 + [2] * (length - 60) + [0] * 10, [1] * length]) if segments else None
  with caplog.at_level(logging.WARNING, logger="llama_jax.model.attention"):
    out = attention.attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, implementation=requested)
  warnings = [r for r in caplog.records if r.name == "llama_jax.model.attention" and r.levelno == logging.WARNING]
  assert len(warnings) == 1, caplog.text
  message = warnings[0].getMessage()
  backend = repr(jax.default_backend())
  assert repr(requested) in message and backend in message and f"using the {fallback} kernel" in message, message
  expected = attention.xla_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6, rtol=0)

  caplog.clear()  # "auto" choosing the same fallback is the normal path: no warning
  with caplog.at_level(logging.WARNING, logger="llama_jax.model.attention"):
    attention.attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, implementation="auto")
  assert not caplog.records, caplog.text


def primitive_names(jaxpr) -> set[str]:
  """Every primitive in a jaxpr, nested ones (scan / map bodies, checkpointed and jitted functions) included."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          names |= primitive_names(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          names |= primitive_names(sub)
  return names


def test_chunked_attention_rematerialises_from_long_sequence_tokens():
  """Model guide: "from 2,048 tokens each chunk is rematerialised, so memory grows with T·chunk rather than T²".

  Checked on the traced program of attention(implementation="auto") on CPU, from abstract shapes (nothing runs): a
  `lax.map` (scan) over `jax.checkpoint`ed chunks (primitive "remat2") at LONG_SEQUENCE tokens, the unrolled chunk
  loop without either just below. Then the memory claim itself on the compiled forward + backward at T=2048 (one
  head of size 8): XLA's temporary buffers must stay below a quarter of one [T, T] float32 score matrix (16 MiB); the
  remat program needs ~3 MiB (a few [chunk=128, T] blocks), the unrolled one 21 MiB.
  """
  assert attention.LONG_SEQUENCE == 2048

  def traced(length):
    q = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    return primitive_names(jax.make_jaxpr(lambda q, k, v: attention.attention(q, k, v))(q, kv, kv).jaxpr)

  long, short = traced(attention.LONG_SEQUENCE), traced(attention.LONG_SEQUENCE // 2)
  assert {"remat2", "scan"} <= long, sorted(long)
  assert not {"remat2", "scan"} & short, sorted(short)

  length = attention.LONG_SEQUENCE
  qkv = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
  grad = jax.grad(lambda q, k, v: jnp.sum(attention.attention(q, k, v)), argnums=(0, 1, 2))
  temp_bytes = jax.jit(grad).lower(qkv, qkv, qkv).compile().memory_analysis().temp_size_in_bytes
  assert temp_bytes < length * length * 4 / 4, f"{temp_bytes / 2**20:.1f} MiB of temporaries at T={length}"
