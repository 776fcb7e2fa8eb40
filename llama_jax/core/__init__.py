"""The bottom layer: what every other layer stands on and that stands on nothing of llama_jax's. Errors (one line,
exit 2), value checks, the model config and the run config, the names and paths of a workdir's files (local or
gs://), joining a multi-process job, the accelerator table, lazy public names."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "LlamaJaxError": "llama_jax.core.errors",
  "FlagError": "llama_jax.core.errors",
  "run_or_exit": "llama_jax.core.errors",
  "ConfigError": "llama_jax.core.checks",
  "ModelConfig": "llama_jax.core.model_config",
  "RunConfig": "llama_jax.core.run_config",
  "TrainConfig": "llama_jax.core.run_config",
  "DataConfig": "llama_jax.core.run_config",
  "MeshConfig": "llama_jax.core.run_config",
  "LoraConfig": "llama_jax.core.run_config",
  "base_run_config": "llama_jax.core.run_config",
  "load_run_config": "llama_jax.core.run_config",
  "run_config_from": "llama_jax.core.run_config",
  "maybe_initialize_distributed": "llama_jax.core.distributed",
  "ACCELERATORS": "llama_jax.core.accelerators",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
