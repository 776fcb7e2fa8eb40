"""LoRA fine-tuning of SmolLM2-135M-Instruct on the conversation corpora that ship in pip packages, in the model's own
ChatML template (its chat_template.jinja, copied by convert), the loss on assistant tokens only.

    python -m llama_jax.convert --from_hf DIR_OF_SMOLLM2 --out runs/smollm2-135m-instruct
    python -m llama_jax.train --config configs/smollm2_sft.py
    python -m llama_jax.convert --to_hf runs/smollm2_sft --peft --out runs/smollm2_sft_adapter

The model section is SmolLM2-135M's (HuggingFaceTB/SmolLM2-135M-Instruct config.json): 134,515,008 parameters, 30
layers of width 576, 9 query heads sharing 3 key/value heads, MLP 1,536, tied embeddings, RoPE θ 100,000, a 49,152-token
byte-level BPE vocabulary. init_from must hold that model (a shape difference is refused in one line). The tokenizer,
chat template and stop tokens come from init_from. Only the rank-8 adapters of the attention and MLP projections
train; the export is a peft adapter for the HF model.
"""

from llama_jax import config as config_lib


def get_config():
  cfg = config_lib.base_run_config()
  cfg.model.update(
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    ffn_hidden_dim=1536,
    max_seq_len=8192,
    norm_eps=1e-5,
    rope_theta=100000.0,
    tie_embeddings=True,
    dtype="float32",
    param_dtype="float32",
  )
  cfg.init_from = "runs/smollm2-135m-instruct"
  cfg.data.update(
    format="chat",
    sources=("chitchat", "chatterbot:english"),
    val_sources=(),
    val_fraction=0.02,
    on_error="skip",
  )
  cfg.train.update(
    lora=dict(rank=8, alpha=16),
    batch_size=8,
    seq_len=512,
    steps=300,
    lr=2e-4,
    warmup_steps=20,
    min_lr_ratio=0.1,
    weight_decay=0.0,
    log_every=20,
    eval_every=100,
    eval_batches=4,
    save_every=100,
  )
  return cfg
