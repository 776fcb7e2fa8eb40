"""Data: the sentencepiece tokenizer, sources of documents, conversations and preference pairs, the LLaMA 2 chat
template, the prepared-data cache every format shares, batches, and the data of one training run. Imports core."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "Tokenizer": "llama_jax.data.tokenization",
  "train_tokenizer": "llama_jax.data.tokenization",
  "resolve_sources": "llama_jax.data.sources",
  "DataError": "llama_jax.data.sources",
  "prepare": "llama_jax.data.text",
  "TokenWindows": "llama_jax.data.text",
  "prepare_sft": "llama_jax.data.sft",
  "prepare_preference": "llama_jax.data.preference",
  "encode_dialog": "llama_jax.data.chat_template",
  "prepare_run_data": "llama_jax.data.run_data",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
