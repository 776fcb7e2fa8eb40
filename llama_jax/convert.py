"""Weights in and out: HF transformers Llama directories ↔ llama_jax checkpoint directories, without torch.

    python -m llama_jax.convert --from_hf HF_DIR --out CKPT_DIR
    python -m llama_jax.convert --to_hf CKPT_DIR --out HF_DIR

RoPE layout: llama_jax rotates the two halves of each head (HF's ``rotate_half``), so HF weights map by transposes and
reshapes only, and a round trip is bit-exact. Meta's original ``consolidated.*.pth`` weights rotate interleaved pairs
(x0,x1), (x2,x3)...; to use them here, permute the rows of wq and wk with ``permute_meta_qk`` first (the same
permutation HF's own conversion script applies).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from llama_jax import checkpoint
from llama_jax.cli import ArgumentParser
from llama_jax.config import ConfigError, ModelConfig
from llama_jax.errors import LlamaJaxError, run_or_exit
from llama_jax.tokenizer import TOKENIZER_FILE

INDEX_FILE = "model.safetensors.index.json"
_DTYPES_FROM_HF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ConvertError(LlamaJaxError, ValueError):
  """The input cannot be converted; the message names the file, tensor or value."""


def permute_meta_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Meta's interleaved-pair rows of a q/k projection [n_heads·H, D] → the half-split layout used here (and by HF)."""
  rows, dim = w.shape
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, dim).transpose(0, 2, 1, 3).reshape(rows, dim)


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """ModelConfig from a transformers Llama ``config.json``; features llama_jax lacks are refused by name."""
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ConvertError(f"config.json sets {key}=true; LLaMA 2 has no biases and llama_jax does not support them")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConvertError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
  dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, dim // n_heads):
    raise ConvertError(
      f"config.json head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
      f"{dim // n_heads}; not supported"
    )
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in _DTYPES_FROM_HF:
    raise ConvertError(f"config.json dtype {dtype!r} is not one of {sorted(_DTYPES_FROM_HF)}")
  rope = dict(hf.get("rope_scaling") or {})
  # transformers ≥ 5 keeps theta and scaling together in rope_parameters.
  rope_parameters = dict(hf.get("rope_parameters") or {})
  theta = rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
  if rope_parameters.get("rope_type", "default") != "default":
    rope = rope_parameters
  kind = rope.get("rope_type", rope.get("type", "none")) if rope else "none"
  kind = "none" if kind == "default" else kind
  fields = dict(
    vocab_size=hf["vocab_size"],
    dim=dim,
    n_layers=hf["num_hidden_layers"],
    n_heads=n_heads,
    n_kv_heads=hf.get("num_key_value_heads") or n_heads,
    ffn_hidden_dim=hf["intermediate_size"],
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope_theta=float(theta),
    max_seq_len=hf.get("max_position_embeddings", 4096),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    dtype=_DTYPES_FROM_HF[dtype],
    param_dtype=_DTYPES_FROM_HF[dtype],
    rope_scaling=kind,
  )
  if kind in ("linear", "llama3"):
    fields["rope_scaling_factor"] = float(rope["factor"])
  if kind == "llama3":
    fields.update(
      rope_low_freq_factor=float(rope["low_freq_factor"]),
      rope_high_freq_factor=float(rope["high_freq_factor"]),
      rope_original_max_len=int(rope["original_max_position_embeddings"]),
    )
  try:
    return ModelConfig(**fields)
  except ConfigError as e:
    raise ConvertError(f"config.json does not describe a valid model: {e}") from e


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
  """A transformers ``config.json`` for LlamaForCausalLM with these hyper-parameters."""
  rope_scaling = None
  if cfg.rope_scaling == "linear":
    rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
  elif cfg.rope_scaling == "llama3":
    rope_scaling = {
      "rope_type": "llama3",
      "factor": cfg.rope_scaling_factor,
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
      "original_max_position_embeddings": cfg.rope_original_max_len,
    }
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "intermediate_size": cfg.hidden_dim,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": rope_scaling,
    "tie_word_embeddings": cfg.tie_embeddings,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": cfg.param_dtype,
  }


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  d, f, h = cfg.dim, cfg.hidden_dim, cfg.head_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.n_layers):
    p = f"model.layers.{i}."
    shapes.update(
      {
        p + "self_attn.q_proj.weight": (cfg.n_heads * h, d),
        p + "self_attn.k_proj.weight": (cfg.n_kv_heads * h, d),
        p + "self_attn.v_proj.weight": (cfg.n_kv_heads * h, d),
        p + "self_attn.o_proj.weight": (d, cfg.n_heads * h),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
      }
    )
  return shapes


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """HF tensors (name → [out, in] arrays) → the llama_jax params tree (numpy, layers stacked on axis 0)."""
  expected = _expected_hf_shapes(cfg)
  missing = sorted(set(expected) - set(tensors))
  if missing:
    raise ConvertError(f"{len(missing)} tensors missing from the safetensors files, e.g. {missing[0]!r}")
  for name, shape in expected.items():
    if tuple(tensors[name].shape) != shape:
      raise ConvertError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, but config.json implies {shape}")
  d, n, k, h = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

  def stack(suffix, fn):
    return np.stack([fn(np.asarray(tensors[f"model.layers.{i}.{suffix}"])) for i in range(cfg.n_layers)])

  params = {
    "embed": np.asarray(tensors["model.embed_tokens.weight"]),
    "final_norm": {"scale": np.asarray(tensors["model.norm.weight"])},
    "layers": {
      "attention_norm": {"scale": stack("input_layernorm.weight", lambda w: w)},
      "mlp_norm": {"scale": stack("post_attention_layernorm.weight", lambda w: w)},
      "attention": {
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, h)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, h)),
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d)),
      },
      "mlp": {
        "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
        "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
      },
    },
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = np.asarray(tensors["lm_head.weight"]).T
  return params


def hf_from_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of ``params_from_hf``: contiguous HF-layout arrays named as transformers names them."""
  d, n, k, h = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  layers, attn, mlp = params["layers"], params["layers"]["attention"], params["layers"]["mlp"]
  out = {
    "model.embed_tokens.weight": np.asarray(params["embed"]),
    "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"]).T
  per_layer = {
    "input_layernorm.weight": (layers["attention_norm"]["scale"], lambda w: w),
    "post_attention_layernorm.weight": (layers["mlp_norm"]["scale"], lambda w: w),
    "self_attn.q_proj.weight": (attn["wq"], lambda w: w.reshape(d, n * h).T),
    "self_attn.k_proj.weight": (attn["wk"], lambda w: w.reshape(d, k * h).T),
    "self_attn.v_proj.weight": (attn["wv"], lambda w: w.reshape(d, k * h).T),
    "self_attn.o_proj.weight": (attn["wo"], lambda w: w.reshape(n * h, d).T),
    "mlp.gate_proj.weight": (mlp["w_gate"], lambda w: w.T),
    "mlp.up_proj.weight": (mlp["w_up"], lambda w: w.T),
    "mlp.down_proj.weight": (mlp["w_down"], lambda w: w.T),
  }
  for suffix, (stacked, fn) in per_layer.items():
    stacked = np.asarray(stacked)
    for i in range(cfg.n_layers):
      out[f"model.layers.{i}.{suffix}"] = fn(stacked[i])
  return {name: np.ascontiguousarray(a) for name, a in out.items()}


def read_hf_dir(hf_dir: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """config.json plus single or sharded (index.json) safetensors of a transformers Llama directory."""
  if not os.path.isdir(hf_dir):
    raise ConvertError(f"HF directory {hf_dir!r} does not exist")
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(config_path):
    raise ConvertError(f"{hf_dir!r} has no config.json")
  with open(config_path) as f:
    hf_config = json.load(f)
  if hf_config.get("model_type", "llama") != "llama":
    raise ConvertError(f"{config_path} has model_type={hf_config['model_type']!r}; only 'llama' is supported")
  cfg = model_config_from_hf(hf_config)
  index_path = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    files = [os.path.join(hf_dir, name) for name in files]
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise ConvertError(f"{hf_dir!r} has no *.safetensors files (PyTorch .bin files are not read: no torch here)")
  tensors = {}
  for path in files:
    if not os.path.isfile(path):
      raise ConvertError(f"{INDEX_FILE} names {os.path.basename(path)!r}, which is missing from {hf_dir!r}")
    with safe_open(path, framework="numpy") as f:
      for name in f.keys():
        tensors[name] = f.get_tensor(name)
  if cfg.tie_embeddings:
    tensors.pop("lm_head.weight", None)  # some exporters write the tied head too; it is the embedding
  dtypes = sorted({str(a.dtype) for a in tensors.values()})
  if len(dtypes) == 1 and dtypes[0] in _DTYPES_FROM_HF:
    cfg = cfg.replace(param_dtype=dtypes[0])  # keep the stored dtype, so a round trip is bit-exact
  return cfg, tensors


def write_hf_dir(
  out_dir: str,
  cfg: ModelConfig,
  params: Mapping[str, Any],
  tokenizer_path: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
) -> None:
  """config.json + model.safetensors (or shards of at most `max_shard_bytes` with an index) that transformers loads."""
  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise ConvertError(f"output directory {out_dir!r} exists and is not empty; choose a new one")
  os.makedirs(out_dir, exist_ok=True)
  tensors = hf_from_params(params, cfg)
  shards, current, size = [], {}, 0
  for name, array in tensors.items():
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
      weight_map.update({tensor: name for tensor in shard})
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump(
        {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}, f, indent=2
      )
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_from_model_config(cfg), f, indent=2)
  if tokenizer_path:
    import shutil

    shutil.copyfile(tokenizer_path, os.path.join(out_dir, TOKENIZER_FILE))


def from_hf(hf_dir: str, out_dir: str) -> ModelConfig:
  """HF directory → new llama_jax checkpoint directory (params at step 0, model config, tokenizer if present)."""
  cfg, tensors = read_hf_dir(hf_dir)
  params = params_from_hf(tensors, cfg)
  tokenizer = os.path.join(hf_dir, TOKENIZER_FILE)
  checkpoint.save_params_dir(out_dir, cfg, params, tokenizer_path=tokenizer if os.path.isfile(tokenizer) else None)
  return cfg


def to_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> ModelConfig:
  """llama_jax checkpoint directory (latest step) → new HF directory."""
  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise ConvertError(f"output directory {out_dir!r} exists and is not empty; choose a new one")
  cfg, params = checkpoint.load_params(checkpoint_dir)
  params = {k: v for k, v in params.items()}
  tokenizer = os.path.join(checkpoint_dir, TOKENIZER_FILE)
  write_hf_dir(out_dir, cfg, params, tokenizer if os.path.isfile(tokenizer) else None, max_shard_bytes)
  return cfg


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m llama_jax.convert", description=__doc__.split("\n\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--from_hf", metavar="HF_DIR", help="transformers Llama directory to read")
  source.add_argument("--to_hf", metavar="CKPT_DIR", help="llama_jax checkpoint directory to export")
  parser.add_argument("--out", required=True, help="new output directory (must not exist or be empty)")
  parser.add_argument("--max_shard_gib", type=float, default=5.0, help="--to_hf: largest safetensors file")
  args = parser.parse_args(argv)
  if args.from_hf:
    cfg = run_or_exit(from_hf, args.from_hf, args.out)
  else:
    cfg = run_or_exit(to_hf, args.to_hf, args.out, int(args.max_shard_gib * 2**30))
  print(f"wrote {args.out}: {cfg.num_params():,} parameters, {cfg.n_layers} layers, dim {cfg.dim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
