"""Train (or resume) a run: ``python -m llama_jax.train --config configs/tiny.py [--workdir DIR] [--config.a.b=v]``.

Rerunning the same command with the same workdir resumes from the latest complete checkpoint, with the same data
order, and reaches bit-identical parameters. Multi-process runs (GPU hosts) pass --coordinator_address,
--num_processes and --process_id; Cloud TPU slices, SLURM and Open MPI need none of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import jax
from absl import flags

from llama_jax import cli
from llama_jax.core import distributed
from llama_jax.core.errors import run_or_exit
from llama_jax.training.loop import Hook
from llama_jax.training.trainer import train


def main(argv=None, hooks: Sequence[Hook] = ()) -> None:
  """The command; `hooks` run after the run's own (tests observe a run this way)."""
  config_flag = cli.define_config_flag(argv, "configs/tiny.py")
  workdir_flag = flags.DEFINE_string(
    "workdir", None, "run directory (checkpoints, metrics, data); default runs/<config name>"
  )
  coordinator_flag = flags.DEFINE_string(
    "coordinator_address",
    None,
    "multi-process runs (e.g. several GPU hosts): "
    "HOST:PORT of process 0; not needed on Cloud TPU slices, SLURM or Open MPI",
  )
  num_processes_flag = flags.DEFINE_integer("num_processes", None, "multi-process runs: the number of processes")
  process_id_flag = flags.DEFINE_integer("process_id", None, "multi-process runs: this process's index, from 0")

  def run(_):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # gcsfs logs each file it opens on gs:// at INFO ("AdaptiveReadaheadCache enabled", dozens per checkpoint).
    for noisy in ("absl", "orbax", "jax", "gcsfs", "fsspec"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    config_path = flags.FLAGS["config"].config_filename
    workdir = workdir_flag.value or os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])
    run_or_exit(
      distributed.maybe_initialize_distributed, coordinator_flag.value, num_processes_flag.value, process_id_flag.value
    )
    result = run_or_exit(train, run_config, workdir, hooks)
    if jax.process_index() == 0 and result["val"]:
      val = result["val"]
      detail = (
        f"bits/byte {val['bits_per_byte']:.4f}"
        if "bits_per_byte" in val
        else f"reward accuracy {val['reward_accuracy']:.4f}, margin {val['margin']:.4f}"
      )
      print(f"done: step {result['step']}, validation loss {val['loss']:.4f}, {detail} (workdir {workdir})")

  defined = (config_flag, workdir_flag, coordinator_flag, num_processes_flag, process_id_flag)
  cli.run_absl_command(run, argv, defined)


if __name__ == "__main__":
  main()
