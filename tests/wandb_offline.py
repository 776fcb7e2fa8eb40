"""What an offline W&B run wrote, read back from its ``run-<id>.wandb`` file without W&B's service: the file is a
LevelDB-style log (a 7-byte ":W&B" header, then 32 KiB blocks of records, each a 7-byte header (CRC-32, length, kind:
1 whole, 2 first, 3 middle, 4 last piece) and its bytes), and each record is a ``wandb_internal_pb2.Record``."""

import glob
import json
import os
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def records(path: str):
  data = open(path, "rb").read()
  if data[:4] != b":W&B":
    raise ValueError(f"{path} is not a W&B run file (starts {data[:7]!r})")
  position, pieces = HEADER, b""
  while position + HEADER <= len(data):
    left_in_block = BLOCK - position % BLOCK
    if left_in_block < HEADER:  # a block's tail too short for a header is padding
      position += left_in_block
      continue
    _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
    pieces += data[position + HEADER : position + HEADER + length]
    position += HEADER + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pieces)
      pieces = b""
      yield record


def offline_runs(wandb_dir: str) -> list[dict]:
  """Each offline run under `wandb_dir` (oldest first): its id, project, config (first record and later updates)
  and history rows (W&B's own "_" keys dropped)."""
  runs = []
  for run_dir in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*"))):
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run = {"id": None, "project": None, "config": {}, "history": []}
    for record in records(path):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        run["id"], run["project"] = record.run.run_id, record.run.project
        run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
      elif kind == "config":
        run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
      elif kind == "history":
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
    runs.append(run)
  return runs
