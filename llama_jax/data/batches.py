"""Batches of prepared examples (text windows, packed conversations, preference pairs), the same way for every
format: endless shuffled training batches split across processes with a one-integer iterator state (grain), and
padded evaluation batches in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from llama_jax.data.sources import DataError


def process_batches(source, global_batch: int, seed: int, process_index: int, process_count: int) -> grain.MapDataset:
  """Endless shuffled batches: global batch i is examples perm[i·B : (i+1)·B]; process p reads only rows
  [p·B/P, (p+1)·B/P) of it, so the global array assembled from all processes (in process order) is the same batch a
  single process would read, and the iterator state (a batch count) means the same for any number of processes."""
  return batches_of(
    grain.MapDataset.source(source).shuffle(seed=seed).repeat(None), global_batch, process_index, process_count
  )


def batches_of(
  examples: grain.MapDataset, global_batch: int, process_index: int, process_count: int
) -> grain.MapDataset:
  """This process's rows of each global batch of an endless dataset of examples (see process_batches)."""
  return examples.batch(local_batch(global_batch, process_count), drop_remainder=True)[process_index::process_count]


def local_batch(global_batch: int, process_count: int) -> int:
  """The rows of a global batch each process reads."""
  if global_batch % process_count:
    raise DataError(f"train.batch_size {global_batch} is not divisible by the {process_count} processes")
  return global_batch // process_count


def eval_batches(
  examples, batch_size: int, max_batches: int = 0, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
  """This process's rows of global batches of `batch_size` examples (windows or packed conversation rows), in order,
  the same every evaluation, at most `max_batches` batches (0: all). Process p takes rows [p·B/P, (p+1)·B/P) of each,
  as in training. Rows past the end are padding with "weights" 0, so every example counts once, shapes never change
  and every process runs the same number of batches."""
  if batch_size % process_count:
    raise DataError(f"train.batch_size {batch_size} is not divisible by the {process_count} processes")
  local = batch_size // process_count
  n_batches = -(-len(examples) // batch_size)
  if max_batches:
    n_batches = min(n_batches, max_batches)
  if not n_batches:
    return
  template = dict(examples[0])
  # Text windows carry no weights (every token counts); preference rows carry their own per side.
  if "targets" in template:
    template.setdefault("weights", np.ones(template["targets"].shape, np.float32))
  padding = {k: np.zeros_like(v) for k, v in template.items()}
  for b in range(n_batches):
    start = b * batch_size + process_index * local
    rows = [dict(examples[i]) for i in range(start, min(start + local, len(examples)))]
    for row in rows:
      if "targets" in row:
        row.setdefault("weights", np.ones(row["targets"].shape, np.float32))
    rows += [padding] * (local - len(rows))
    yield {k: np.stack([row[k] for row in rows]) for k in template}


def train_batches(
  rows, global_batch: int, seed: int, process_index: int, process_count: int, what: str, unit: str
) -> grain.MapDataset:
  """Endless shuffled batches of prepared rows (SFT conversations or preference pairs), refused in one line when the
  training split cannot fill one batch."""
  if len(rows) < global_batch:
    raise DataError(
      f"too few {what} for one batch: {len(rows)} {unit}, but a batch needs {global_batch}; add data or lower "
      f"train.batch_size"
    )
  return process_batches(rows, global_batch, seed, process_index, process_count)
