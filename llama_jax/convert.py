"""Weights in and out: HF transformers Llama directories and Meta's original LLaMA 2 and Llama 3.x downloads →
llama_jax checkpoint directories, and llama_jax checkpoints → HF directories.

    python -m llama_jax.convert --from_hf HF_DIR --out CKPT_DIR      # config.json + (sharded) *.safetensors
    python -m llama_jax.convert --from_meta META_DIR --out CKPT_DIR  # params.json + consolidated.NN.pth (needs torch)
    python -m llama_jax.convert --to_hf CKPT_DIR --out HF_DIR        # → config.json + *.safetensors for transformers
    python -m llama_jax.convert --merge_lora LORA_DIR --out CKPT_DIR  # a LoRA workdir's base + adapters, merged
    python -m llama_jax.convert --to_hf LORA_DIR --peft --out DIR    # its adapter for HF peft

The conversions are ``interop/``'s (hf.py, meta.py, peft.py): streamed tensor by tensor, everything checked before
the output directory is created, and the output written beside it and renamed into place.
"""

from __future__ import annotations

import sys

from llama_jax import cli
from llama_jax.core.errors import run_or_exit
from llama_jax.interop.hf import from_hf, to_hf
from llama_jax.interop.meta import from_meta
from llama_jax.interop.peft import merge_lora, to_peft


def main(argv: list[str] | None = None) -> int:
  parser = cli.ArgumentParser(
    prog="python -m llama_jax.convert",
    description=__doc__.split("\n\n")[0] + " Streams tensor by tensor: peak memory stays near the model's size.",
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument(
    "--from_hf", metavar="HF_DIR", help="transformers Llama directory to read (config.json, *.safetensors)"
  )
  source.add_argument(
    "--from_meta",
    metavar="META_DIR",
    help="Meta's original LLaMA 2 or Llama 3.x download to read: params.json (use_scaled_rope: llama3 RoPE "
    "scaling), consolidated.NN.pth model-parallel shards (merged; needs torch), tokenizer.model (a sentencepiece "
    "one is copied; Llama 3's tiktoken table is not read)",
  )
  source.add_argument(
    "--to_hf",
    metavar="CKPT_DIR",
    help="llama_jax checkpoint directory to export (latest step); a LoRA workdir exports its merged weights, or with "
    "--peft its adapter",
  )
  source.add_argument(
    "--merge_lora",
    metavar="LORA_DIR",
    help="LoRA workdir → llama_jax checkpoint directory of the merged weights (base + scale·A·B)",
  )
  parser.add_argument("--out", required=True, help="new output directory (must not exist or be empty)")
  parser.add_argument("--max_shard_gib", type=float, default=5.0, help="--to_hf: largest safetensors file")
  parser.add_argument("--step", type=int, help="--to_hf, --merge_lora: checkpoint step to export (default: the latest)")
  parser.add_argument(
    "--peft",
    action="store_true",
    help="--to_hf of a LoRA workdir: write a peft adapter (adapter_config.json, adapter_model.safetensors) for the "
    "HF export of its base instead of merged weights",
  )
  args = parser.parse_args(argv)
  if args.peft and not args.to_hf:
    parser.error("--peft goes with --to_hf LORA_DIR")
  if args.from_hf:
    cfg = run_or_exit(from_hf, args.from_hf, args.out)
  elif args.from_meta:
    cfg, tokenizer_line = run_or_exit(from_meta, args.from_meta, args.out)
    print(tokenizer_line)
  elif args.merge_lora:
    cfg = run_or_exit(merge_lora, args.merge_lora, args.out, args.step)
  elif args.peft:
    cfg = run_or_exit(to_peft, args.to_hf, args.out, args.step)
    print(f"wrote {args.out}: a peft LoRA adapter for the HF export of its base")
    return 0
  else:
    cfg = run_or_exit(to_hf, args.to_hf, args.out, int(args.max_shard_gib * 2**30), args.step)
  print(f"wrote {args.out}: {cfg.num_params():,} parameters, {cfg.n_layers} layers, dim {cfg.dim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
