"""paths.atomic_write, the one way files are replaced whole (tokenizers, prepared shards and their meta.json,
preference pairs, goodput and tracker records, checkpoint digests, the local copies of remote files): a reader sees
the old file or the new one, never part of one, and a failed write leaves the old file and no temporary file. Its
gs:// branch runs against the GCS emulator in tests/checkpoint/test_gcs_workdir.py and tests/data/test_pipeline.py."""

import os
import threading

import pytest

from llama_jax.core import paths


def test_a_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
  target = tmp_path / "meta.json"
  target.write_text("old")
  with paths.atomic_write(target) as f:
    f.write("naïve ünïcode")
    assert target.read_text() == "old"  # not yet replaced while the block runs
  assert target.read_text(encoding="utf-8") == "naïve ünïcode"
  assert os.listdir(tmp_path) == ["meta.json"]


def test_an_error_inside_the_block_leaves_the_old_file_and_no_temporary_file(tmp_path):
  target = tmp_path / "shard.bin"
  target.write_bytes(b"old")
  with pytest.raises(RuntimeError, match="mid-write"):
    with paths.atomic_write(target, "wb") as f:
      f.write(b"new, half written")
      raise RuntimeError("mid-write")
  assert target.read_bytes() == b"old"
  assert os.listdir(tmp_path) == ["shard.bin"]


def test_a_bad_mode_is_refused_naming_it(tmp_path):
  with pytest.raises(ValueError, match=r"mode must be 'w' or 'wb', got 'a'"):
    with paths.atomic_write(tmp_path / "x", "a"):
      pass


def test_writers_racing_on_one_file_each_leave_it_whole_and_readers_never_see_part_of_one(tmp_path):
  """Four threads rewrite one file 50 times each with their own 1 MiB content while a reader reads it: every read
  is one writer's whole content (the temporary names are unique per call, so no writer renames another's half)."""
  target = tmp_path / "records.json"
  contents = [bytes([i]) * 2**20 for i in range(4)]
  target.write_bytes(contents[0])
  done = threading.Event()
  seen, errors = [], []

  def write(content):
    try:
      for _ in range(50):
        paths.write_atomically(target, content)
    except Exception as e:  # noqa: BLE001 (reported by the assertion below)
      errors.append(e)

  def read():
    while not done.is_set():
      seen.append(target.read_bytes())

  reader = threading.Thread(target=read)
  reader.start()
  writers = [threading.Thread(target=write, args=(c,)) for c in contents]
  for w in writers:
    w.start()
  for w in writers:
    w.join(timeout=300)
  done.set()
  reader.join(timeout=300)
  assert not errors, errors
  assert seen and all(data in contents for data in seen), {len(data) for data in seen}
  assert target.read_bytes() in contents
  assert os.listdir(tmp_path) == ["records.json"]
