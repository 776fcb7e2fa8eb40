"""Looking at programs and models: collectives and kernels read from compiled HLO, memory plans of training and
decoding (the TPU compiler included), and the inspection forward with its pictures. The top layer: imports any
layer below."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "inspect_forward": "llama_jax.analysis.inspection",
  "tpu_devices": "llama_jax.analysis.tpu",
  "summarize": "llama_jax.analysis.hlo",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
