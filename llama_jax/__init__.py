"""llama_jax: LLaMA in JAX and Flax NNX, from tokenizer training to pretraining, fine-tuning, evaluation and serving.

The package is laid out by layer, each importing only from the layers above it in this list (import-linter checks it):

    core        errors, checks, model and run configs, paths, multi-process jobs, accelerators
    model       the nnx modules, attention kernels, KV cache, LoRA maths, int8, losses, mesh and logical axes
    data        tokenizer, sources, chat template, prepared-data cache, SFT and preference data, batches
    checkpoint  digests, parameters (one reader), training checkpoints, run records, the workdir lock
    training    the pure step, optimizer, FLOPs, metrics, loop and hooks, Trainer and train()
    inference   placement on a decode mesh, sampling, Sampler, Engine, evaluation
    serving     the OpenAI-compatible application (the serve extra)
    interop     HF, Meta and peft conversions
    analysis    compiled-HLO reading, memory plans, the inspection forward and its pictures

The commands users type are thin modules beside them: ``python -m llama_jax.train`` (and ``sample``, ``evaluate``,
``serve``, ``convert``, ``plan``, ``viz``, ``tokenizer``, ``config``, ``preference_data``), or ``llama-jax train``.

What a user imports is named here and in each layer's ``__init__`` (imported when first used). Functions that share a
command's name are reached through their layer, so ``llama_jax.train`` always means one thing (the command module):
``llama_jax.training.train``, ``llama_jax.inference.evaluate``, ``llama_jax.interop.from_hf`` / ``to_hf``.
"""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "ModelConfig": "llama_jax.core.model_config",
  "RunConfig": "llama_jax.core.run_config",
  "base_run_config": "llama_jax.core.run_config",
  "load_run_config": "llama_jax.core.run_config",
  "run_config_from": "llama_jax.core.run_config",
  "LlamaJaxError": "llama_jax.core.errors",
  "Llama": "llama_jax.model.llama",
  "KVCache": "llama_jax.model.kv_cache",
  "Tokenizer": "llama_jax.data.tokenization",
  "load_params": "llama_jax.checkpoint.params",
  "Trainer": "llama_jax.training.trainer",
  "Sampler": "llama_jax.inference.sampler",
  "SamplingConfig": "llama_jax.inference.sampling",
  "load_sampler": "llama_jax.inference.sampler",
  "Engine": "llama_jax.inference.engine",
  "Request": "llama_jax.inference.engine",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
