"""Weights in and out: HF transformers directories (safetensors streamed tensor by tensor), Meta's original
downloads, and LoRA workdirs as merged checkpoints or peft adapters. Imports checkpoint and below."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "from_hf": "llama_jax.interop.hf",
  "to_hf": "llama_jax.interop.hf",
  "from_meta": "llama_jax.interop.meta",
  "merge_lora": "llama_jax.interop.peft",
  "to_peft": "llama_jax.interop.peft",
  "model_config_from_hf": "llama_jax.interop.hf_config",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
