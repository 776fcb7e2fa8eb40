"""A fine-tune's init_from against the run's model config: a shape difference is refused in one line, a difference
in what the parameters compute (RoPE, norm epsilon) is warned about, and float noise in norm_eps is neither."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.checkpoint.digests import CheckpointError
from tests.live_server import tiny_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_tokenizer):
  directory = tiny_checkpoint(str(tmp_path_factory.mktemp("init_from") / "ckpt"), small_tokenizer)
  return directory, checkpoint_params.read_model_config(directory)


def test_a_shape_difference_is_refused(saved):
  directory, cfg = saved
  with pytest.raises(CheckpointError, match=r"holds a different model \(n_kv_heads 2 → 4\)"):
    checkpoint_params.check_same_model(directory, dataclasses.replace(cfg, n_kv_heads=4))


def test_a_function_difference_is_warned_about(saved, caplog):
  directory, cfg = saved
  with caplog.at_level(logging.WARNING):
    checkpoint_params.check_same_model(directory, dataclasses.replace(cfg, rope_theta=500000.0, norm_eps=1e-6))
  assert "rope_theta 10000.0 → 500000.0" in caplog.text and "norm_eps 1e-05 → 1e-06" in caplog.text


def test_the_same_model_up_to_float32_noise_passes_silently(saved, caplog):
  directory, cfg = saved
  with caplog.at_level(logging.WARNING):
    checkpoint_params.check_same_model(directory, cfg)
    checkpoint_params.check_same_model(directory, dataclasses.replace(cfg, norm_eps=9.999999747378752e-06))
  assert caplog.text == ""
