"""Both tokenizer back ends against transformers' AutoTokenizer on the same files: ids, decoded text, bos, batch
encoding and the bits-per-byte table, on 240 strings (Chinese, emoji, code, whitespace runs, special tokens in text)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import transformers

from llama_jax.core import paths
from llama_jax.data.hf_tokenizer import HFTokenizer
from llama_jax.data.tokenization import Tokenizer, TokenizerError
from llama_jax.data.tokenizer_files import load_tokenizer_dir, load_tokenizer_path
from tests import hf_tokenizers

PIECES = [
  "Hello, world!",
  "Shall I compare thee to a summer's day?",
  "  two leading spaces",
  "trailing spaces   ",
  "tabs\tand\nnewlines\n\n\nthree",
  "深度学习模型的训练需要大量的数据。",
  "日本語のテキストとカタカナ",
  "한국어 문장입니다",
  "Привет, как дела?",
  "مرحبا بالعالم",
  "emoji 😀🎉👍🏽 and 🇫🇷 flags",
  "family 👨‍👩‍👧‍👦 zwj",
  "def f(x):\n    return x ** 2  # square\n",
  "for (int i = 0; i < n; ++i) { sum += a[i]; }",
  '{"key": [1, 2.5, null], "nested": {"a": "b"}}',
  "    indented\n        more indented",
  "numbers 1234567890 3.14159 -42 1e-5",
  "café naïve résumé — “quotes” ‘single’ …",
  "combining e\u0301 vs é",
  "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
  "URL https://example.org/path?q=1&r=2#frag",
  "CamelCaseIdentifier snake_case_name kebab-case",
  "<html><body>tags</body></html>",
  "       ",
  "\n",
  "a",
  "!!!???...",
  "don't won't it's I'm you're",
  "x" * 50,
  "ÀÉÎÕÜ àéîõü ßæøå",
]
SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|begin_of_text|>"]


def strings() -> list[str]:
  """The 30 pieces, each with a special token's text inside, and 180 random mixes of them (seeded)."""
  rng = random.Random(0)
  out = list(PIECES)
  out += [f"{p}{SPECIALS[i % len(SPECIALS)]}{PIECES[(i + 7) % len(PIECES)]}" for i, p in enumerate(PIECES)]
  for _ in range(180):
    parts = rng.sample(PIECES, rng.randint(2, 4))
    if rng.random() < 0.3:
      parts.insert(rng.randrange(len(parts) + 1), rng.choice(SPECIALS))
    out.append(rng.choice(["", " ", "\n", "  "]).join(parts))
  return out


STRINGS = strings()


def test_strings_cover_what_the_issue_names():
  assert len(STRINGS) >= 200
  assert any("学习" in s for s in STRINGS) and any("😀" in s for s in STRINGS) and any("return" in s for s in STRINGS)
  assert any("   " in s for s in STRINGS) and sum(any(t in s for t in SPECIALS) for s in STRINGS) > 30


def assert_same_as_transformers(ours, reference, *, specials_in_text_are_text=False):
  # transformers 5 reads special-token texts in input text as the special ids; the sentencepiece back end reads
  # them as text (a LLaMA 2 prompt cannot forge <s>), which transformers does with split_special_tokens.
  kwargs = {"split_special_tokens": True} if specials_in_text_are_text else {}
  batch = ours.encode_batch(STRINGS)
  for text, batched in zip(STRINGS, batch):
    expected = reference(text, **kwargs)["input_ids"]
    assert ours.encode(text, bos=True) == expected, text
    plain = reference.encode(text, add_special_tokens=False, **kwargs)
    assert ours.encode(text) == plain == batched, text
    assert ours.decode(plain) == reference.decode(plain, skip_special_tokens=True), text


@pytest.mark.usefixtures("smollm2_tokenizer")
def test_byte_level_bpe_of_smollm2_equals_transformers(smollm2_tokenizer):
  ours = load_tokenizer_dir(smollm2_tokenizer)
  assert isinstance(ours, HFTokenizer) and ours.vocab_size == 49152
  assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.adds_bos) == (1, 2, 0, False)  # SmolLM2 adds no bos
  assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer))


def test_llama3_style_tokenizer_adds_bos_from_its_post_processor(llama3_style_tokenizer):
  ours = load_tokenizer_dir(llama3_style_tokenizer)
  assert ours.adds_bos and ours.id_to_piece(ours.bos_id) == "<|begin_of_text|>"
  assert ours.id_to_piece(ours.eos_id) == "<|eot_id|>"
  assert {ours.id_to_piece(i) for i in ours.stop_ids} == {"<|eot_id|>", "<|end_of_text|>"}
  assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(llama3_style_tokenizer))


def test_sentencepiece_style_tokenizer_json_of_llama2_equals_transformers(llama2_hf_tokenizer):
  ours = load_tokenizer_dir(llama2_hf_tokenizer)
  assert isinstance(ours, HFTokenizer) and ours.adds_bos and ours.vocab_size == 32000
  assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(llama2_hf_tokenizer))


def test_sentencepiece_back_end_equals_transformers(llama2_hf_tokenizer, tmp_path):
  """Meta's tokenizer.model through sentencepiece vs transformers on HF's conversion of it: the same ids, with
  special-token texts as text."""
  directory = hf_tokenizers.with_sentencepiece(llama2_hf_tokenizer, str(tmp_path / "sp"))
  ours = load_tokenizer_dir(directory)
  assert isinstance(ours, Tokenizer)
  reference = transformers.AutoTokenizer.from_pretrained(llama2_hf_tokenizer)
  assert_same_as_transformers(ours, reference, specials_in_text_are_text=True)
  hf_ids = load_tokenizer_dir(llama2_hf_tokenizer)
  plain = [s for s in STRINGS if not any(t in s for t in SPECIALS)]
  assert [ours.encode(s) for s in plain] == [hf_ids.encode(s) for s in plain]  # the two back ends agree


@pytest.mark.parametrize("which", ["smollm2_tokenizer", "llama3_style_tokenizer", "llama2_hf_tokenizer"])
def test_token_byte_lengths_count_the_bytes_of_the_text(which, request):
  """Summed over encode(s): the UTF-8 bytes of the decoded text for byte-level BPE (special tokens count 0); for
  the sentencepiece-style tokenizer.json, as for sentencepiece itself, one more for a text without special tokens
  (the prefix space that decode drops)."""
  ours = load_tokenizer_dir(request.getfixturevalue(which))
  lengths = ours.token_byte_lengths()
  assert lengths.shape == (ours.vocab_size,) and lengths.dtype == np.int32
  for text in STRINGS:
    ids = ours.encode(text)
    counted, decoded = int(lengths[ids].sum()), len(ours.decode(ids).encode("utf-8"))
    if which != "llama2_hf_tokenizer":
      assert counted == decoded, text
    elif not any(t in text for t in SPECIALS):
      assert counted == len(text.encode("utf-8")) + 1 == decoded + 1, text
  assert all(lengths[i] == 0 for i in ours.special_ids)


def test_tokenizer_files_travel_whole(smollm2_tokenizer):
  ours = load_tokenizer_dir(smollm2_tokenizer)
  files = ours.files()
  assert set(files) == {paths.HF_TOKENIZER_FILE, paths.TOKENIZER_CONFIG_FILE, paths.CHAT_TEMPLATE_FILE}
  for name, content in files.items():
    with open(os.path.join(smollm2_tokenizer, name), "rb") as f:
      assert f.read() == content
  assert load_tokenizer_path(os.path.join(smollm2_tokenizer, "tokenizer.json")).encode("hi") == ours.encode("hi")
  assert load_tokenizer_path(smollm2_tokenizer).encode("hi") == ours.encode("hi")


def test_bad_tokenizer_files_are_one_line_errors(smollm2_tokenizer, tmp_path):
  with open(os.path.join(smollm2_tokenizer, "tokenizer.json"), "rb") as f:
    good = f.read()
  with pytest.raises(TokenizerError, match="is not a tokenizers tokenizer.json"):
    HFTokenizer(b'{"model": 3}', {}, str(tmp_path))
  config = json.dumps({"eos_token": "<|nowhere|>"}).encode()
  with pytest.raises(TokenizerError, match=r"eos_token '<\|nowhere\|>' is not in the vocabulary"):
    HFTokenizer(good, {paths.TOKENIZER_CONFIG_FILE: config}, str(tmp_path))
  with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
    HFTokenizer(good, {paths.TOKENIZER_CONFIG_FILE: b"{"}, str(tmp_path))
  with pytest.raises(TokenizerError, match="holds neither tokenizer.model nor tokenizer.json"):
    load_tokenizer_path(str(tmp_path))
