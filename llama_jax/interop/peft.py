"""LoRA workdirs out: as a llama_jax checkpoint directory of merged weights (`merge_lora`, a plain model every command
reads and a base for another run), or as an HF peft adapter (`to_peft`: adapter_config.json and
adapter_model.safetensors) for the HF export of its base (``to_hf BASE``); ``PeftModel.from_pretrained(base, out)``
then gives this model's logits.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.checkpoint import records
from llama_jax.core import paths
from llama_jax.core.model_config import ModelConfig
from llama_jax.core.run_config import LoraConfig
from llama_jax.interop.hf import HF_MODULES, empty_params
from llama_jax.interop.hf_config import check_hf_expressible
from llama_jax.interop.output import (
  ConvertError,
  check_new_output,
  new_output_dir,
  tokenizer_extras_in,
  tokenizer_in,
)
from llama_jax.model import lora as lora_lib
from llama_jax.model.layer_layout import layer_params

ADAPTER_CONFIG, ADAPTER_TENSORS = "adapter_config.json", "adapter_model.safetensors"


def peft_tensors(adapters: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """peft's ``adapter_model.safetensors`` tensors of stacked adapters: lora_A [rank, in], lora_B [out, rank] per layer
  (torch Linear layout), named as peft saves them for LlamaForCausalLM."""
  out = {}
  for i, layer in enumerate(layer_params(adapters.get("layers", {})) if adapters.get("layers") else []):
    for name, (group, _) in lora_lib.TARGETS.items():
      node = layer.get(group, {})
      if name + lora_lib.A_SUFFIX not in node:
        continue
      a = np.asarray(node[name + lora_lib.A_SUFFIX], np.float32)
      b = np.asarray(node[name + lora_lib.B_SUFFIX], np.float32)
      rank = a.shape[-1]
      prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[name]}"
      out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
      out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)
  return out


def peft_config(lora: LoraConfig, base_model: str) -> dict[str, Any]:
  """peft's adapter_config.json for these adapters: plain LoRA (no dropout, no bias, no rsLoRA)."""
  return dict(
    peft_type="LORA",
    task_type="CAUSAL_LM",
    base_model_name_or_path=base_model,
    r=lora.rank,
    lora_alpha=lora.alpha,
    lora_dropout=0.0,
    target_modules=sorted(HF_MODULES[t].split(".")[-1] for t in lora.targets),
    bias="none",
    fan_in_fan_out=False,
    use_rslora=False,
    use_dora=False,
    init_lora_weights=True,
    inference_mode=True,
    modules_to_save=None,
    layers_to_transform=None,
    layers_pattern=None,
    rank_pattern={},
    alpha_pattern={},
  )


def _lora_record(directory: str) -> dict[str, Any]:
  record = records.read_record(directory)
  if record is None:
    raise ConvertError(f"{directory!r} is not a LoRA workdir: it has no {paths.LORA_FILE}")
  return record


def merge_lora(checkpoint_dir: str, out_dir: str, step: int | None = None) -> ModelConfig:
  """Converts a LoRA workdir into a new llama_jax checkpoint directory of the merged weights.

  Each targeted weight becomes W + scale·A·B, the reader's one merge, so this directory reads back as the same bits
  the workdir reads as: a plain model every command reads, and a base for another run. The workdir's tokenizer and
  its side files are copied along.

  Args:
    checkpoint_dir: the LoRA workdir.
    out_dir: the new checkpoint directory; it must not exist or be empty.
    step: the workdir's step to merge, or None for the latest complete one.

  Returns:
    The model config, the base's.

  Raises:
    ConvertError: `checkpoint_dir` is not a LoRA workdir, or `out_dir` is not empty.
    LoraError: the base the workdir adapts has changed since the run started from it.
    CheckpointError: the base's or the workdir's step is missing or damaged.
  """
  record = _lora_record(checkpoint_dir)
  check_new_output(out_dir)
  with contextlib.closing(checkpoint_params.MergedReader(checkpoint_dir, record, step)) as reader:
    cfg = reader.cfg
    params = jax.tree_util.tree_map_with_path(
      lambda path, _: reader.read_leaf(tuple(k.key for k in path)), empty_params(cfg)
    )
  with new_output_dir(out_dir) as scratch:
    tokenizer, generation = tokenizer_in(checkpoint_dir), tokenizer_extras_in(checkpoint_dir)
    checkpoint_params.save_params_dir(scratch, cfg, params, tokenizer_path=tokenizer, extra_files=generation)
  return cfg


def to_peft(checkpoint_dir: str, out_dir: str, step: int | None = None) -> ModelConfig:
  """Converts a LoRA workdir into a new peft adapter directory for the HF export of its base.

  The directory holds adapter_config.json, plain LoRA, and adapter_model.safetensors, named as peft saves them for
  LlamaForCausalLM. ``PeftModel.from_pretrained(base, out_dir)`` on the base's `to_hf` export then gives this
  model's logits.

  Args:
    checkpoint_dir: the LoRA workdir.
    out_dir: the new adapter directory; it must not exist or be empty.
    step: the workdir's step to export, or None for the latest complete one.

  Returns:
    The workdir's model config.

  Raises:
    ConvertError: `checkpoint_dir` is not a LoRA workdir, `out_dir` is not empty, or the base has no HF form.
    LoraError: the base the workdir adapts has changed since the run started from it.
    CheckpointError: the workdir's step is missing or damaged.
  """
  record = _lora_record(checkpoint_dir)
  check_new_output(out_dir)
  records.check_base(checkpoint_dir, record)
  cfg, lora = checkpoint_params.read_model_config(checkpoint_dir), records.lora_config_of(record)
  check_hf_expressible(cfg, checkpoint_dir)  # a peft adapter needs an HF base to sit on
  _, adapters = checkpoint_params.read_adapters(checkpoint_dir, cfg, lora, step)
  with new_output_dir(out_dir) as scratch:
    safetensors.numpy.save_file(peft_tensors(adapters, cfg), os.path.join(scratch, ADAPTER_TENSORS), {"format": "pt"})
    with open(os.path.join(scratch, ADAPTER_CONFIG), "w") as f:
      json.dump(peft_config(lora, record["base"]), f, indent=2, sort_keys=True)
  return cfg
