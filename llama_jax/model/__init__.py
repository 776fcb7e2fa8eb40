"""The model: LLaMA as flax.nnx modules with grouped-query attention over four kernels, an explicit KV cache,
LoRA adapters, weight-only int8, the losses of training and evaluation, and the mesh with its logical-axis rules.
Imports only core."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "Llama": "llama_jax.model.llama",
  "KVCache": "llama_jax.model.kv_cache",
  "unstack_layers": "llama_jax.model.layer_layout",
  "make_mesh": "llama_jax.model.sharding",
  "abstract_params": "llama_jax.model.sharding",
  "init_model": "llama_jax.model.sharding",
  "quantize_params": "llama_jax.model.quantize",
  "token_losses": "llama_jax.model.loss",
  "dpo_losses": "llama_jax.model.loss",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
