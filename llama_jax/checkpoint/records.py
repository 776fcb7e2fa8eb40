"""What a run keeps frozen, recorded in its workdir: a LoRA workdir's ``lora.json`` (the adapter settings and the base
checkpoint step they adapt) and a full DPO workdir's ``reference.json`` (the step of its reference model), each with
the digest of that step's files, so a base retrained or replaced under the same path is refused instead of silently
adapted.

A LoRA training workdir holds only the adapters (its checkpoints' "params") and ``lora.json``; ``params.open_reader``
reads such a workdir as the merged model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from llama_jax.core import paths
from llama_jax.core.errors import LlamaJaxError
from llama_jax.core.run_config import LoraConfig


class LoraError(LlamaJaxError, ValueError):
  """A LoRA workdir or adapter does not fit its base model; the message names the file and the difference."""


def base_record(lora: LoraConfig, base_dir: str, base_step: int) -> dict[str, Any]:
  """What lora.json says: the adapter settings and the base checkpoint step they adapt (with its digest, so a
  base retrained or replaced under the same path is noticed)."""
  return dict(rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets), **frozen_record(base_dir, base_step))


def frozen_record(base_dir: str, base_step: int) -> dict[str, Any]:
  """The checkpoint step a run keeps frozen (a LoRA base, a DPO reference) and the digest of its files."""
  return dict(base=paths.absolute(base_dir), base_step=base_step, base_digest=step_digest(base_dir, base_step))


def step_digest(directory: str, step: int) -> str | None:
  """One digest of a step's digests.json (the sizes and sha256 of its files, however laid out); None without one."""
  digests = paths.step_path(directory, step) / paths.DIGESTS_FILE
  if not digests.exists():
    return None
  files = json.loads(digests.read_text())["files"]
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_record(workdir: str, record: dict[str, Any], name: str = paths.LORA_FILE) -> None:
  paths.write_atomically(paths.path(workdir, name), json.dumps(record, indent=2, sort_keys=True))


def read_record(directory: str, name: str = paths.LORA_FILE) -> dict[str, Any] | None:
  """lora.json of a LoRA workdir (or another record `name`), or None where there is none."""
  path = paths.path(directory, name)
  if not path.is_file():
    return None
  return json.loads(path.read_text())


def check_base(directory: str, record: Mapping[str, Any]) -> None:
  """Refuses a base (or DPO reference) whose checkpoint step changed since the run started from it."""
  now = step_digest(record["base"], record["base_step"])
  if record.get("base_digest") and now != record["base_digest"]:
    what = (
      f"{paths.path(directory, paths.LORA_FILE)} adapts"
      if "rank" in record
      else (f"{paths.path(directory, paths.REFERENCE_FILE)} takes its DPO reference from")
    )
    raise LoraError(
      f"{what} step {record['base_step']} of {record['base']!r}, whose files have changed since (digest "
      f"{str(now)[:12]} ≠ {record['base_digest'][:12]}); restore that checkpoint or start a new run"
    )


def lora_config_of(record: Mapping[str, Any]) -> LoraConfig:
  return LoraConfig(rank=record["rank"], alpha=record["alpha"], targets=tuple(record["targets"]))
