"""Inference: weights placed on a decode mesh, sampling settings and the one filter, the Sampler (prefill and a
jitted decode loop), the continuous-batching Engine, evaluation of a checkpoint, and a chat session on a terminal.
Imports core, model, data and checkpoint; never training."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "Sampler": "llama_jax.inference.sampler",
  "load_sampler": "llama_jax.inference.sampler",
  "SamplingConfig": "llama_jax.inference.sampling",
  "Engine": "llama_jax.inference.engine",
  "Request": "llama_jax.inference.requests",
  "Output": "llama_jax.inference.requests",
  "Collector": "llama_jax.inference.requests",
  "EngineError": "llama_jax.inference.requests",
  "evaluate": "llama_jax.inference.evaluation",
  "decode_mesh": "llama_jax.inference.placement",
  "place_params": "llama_jax.inference.placement",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
