"""The seed's Mini-GPT recipe on the LLaMA blocks: d_model 256, 4 layers, 4 heads, d_ff 1024, warmup 500 → 3e-4.

    python -m llama_jax.train --config configs/minigpt.py [--config.data.sources="('my_corpus/',)"]
    python -m llama_jax.evaluate --checkpoint runs/minigpt       # loss, perplexity and word-level perplexity

The seed (``transformer-revisited-minigpt.txt``) trains its ~200-line Mini-GPT on wikitext-2 for 3 epochs with the
learning rate warmed up over 500 steps to 3e-4 and quotes word-level perplexity < 50. Here the blocks are LLaMA's
(RMSNorm pre-norm, RoPE, SwiGLU: an MLP of width 1024 has three matrices where the seed's GELU MLP has two), with an
untied LM head as the seed's. wikitext-2 cannot be downloaded on this project's machines (no network), so the default
data are the Shakespeare plays of configs/tiny.py, held out the same way; any text files, directories, globs or JSONL
go through ``data.sources`` (wikitext-2's raw train file, where it can be fetched, with ``data.val_sources`` its
validation file). Word-level perplexity depends on the text and its tokenizer's words, so figures on Shakespeare do
not compare with the seed's wikitext-2 figure.
"""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(
    vocab_size=4096,
    dim=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    ffn_hidden_dim=1024,
    max_seq_len=256,
    tie_embeddings=False,
    dtype="float32",
    param_dtype="float32",
    scan_layers=False,  # four layers unroll cheaply on CPU (see tiny.py)
  )
  cfg.data.update(
    sources=("shakespeare",), val_sources=("shakespeare:hamlet,macbeth,tempest,twelfth_night",), vocab_size=4096
  )
  cfg.train.update(
    batch_size=8,
    seq_len=256,
    # The seed's 3 epochs: the plays' training split is 1,597,696 tokens (tokenizer of configs/tiny.py), so 3 epochs
    # at 8 × 256 tokens a step are 2,340 steps.
    steps=2340,
    lr=3e-4,
    warmup_steps=500,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    log_every=50,
    eval_every=500,
    eval_batches=0,
    save_every=500,
  )
  return cfg
