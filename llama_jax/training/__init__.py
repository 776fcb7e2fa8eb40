"""Training: the pure jitted step, the optimizer, model FLOPs, metrics sinks (TensorBoard, W&B, MLflow), goodput,
the loop and its hooks, and the Trainer with ``train()``. Imports core, model, data and checkpoint; never inference
or serving."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "Trainer": "llama_jax.training.trainer",
  "train": "llama_jax.training.trainer",
  "train_step": "llama_jax.training.step",
  "TrainLoop": "llama_jax.training.loop",
  "Hook": "llama_jax.training.loop",
  "make_optimizer": "llama_jax.training.optimizer",
  "MetricsWriter": "llama_jax.training.metrics",
  "GoodputLedger": "llama_jax.training.goodput",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
