"""Checkpoint directories: digests of every step, parameters written once and read by one reader (whole or leaf by
leaf, a LoRA workdir merged), training checkpoints with resume and fallback, the records of what a run keeps frozen,
and the workdir lock. Imports core, model and data."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "load_params": "llama_jax.checkpoint.params",
  "open_reader": "llama_jax.checkpoint.params",
  "read_model_config": "llama_jax.checkpoint.params",
  "save_params_dir": "llama_jax.checkpoint.params",
  "CheckpointError": "llama_jax.checkpoint.digests",
  "TrainCheckpointer": "llama_jax.checkpoint.train_state",
  "WorkdirLock": "llama_jax.checkpoint.workdir_lock",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
