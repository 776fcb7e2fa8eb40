"""Prepare a pretraining corpus into tokenized ArrayRecord shards with an Apache Beam pipeline:

    python -m llama_jax.prepare --config configs/X.py --out DIR [--config.data.x=...] [Beam pipeline options]

The run config's ``data.sources`` (and ``data.val_sources`` / ``data.val_fraction``, ``data.text_field``,
``data.on_error``) are read and tokenized with ``data.tokenizer``, one input file per unit of work, into DIR (local
or gs://): shards of tokenized documents, the tokenizer, and ``index.json`` (data/token_shards.py). Train on them with
``--config.data.prepared_dir=DIR``. Rerunning the command prepares only what is missing (after a kill, or for files
added to the sources); a changed file, tokenizer or setting prepares its files again.

Beam options go to the pipeline as they are, e.g. on this machine
``--direct_num_workers 2 --direct_running_mode multi_processing`` (the default: DirectRunner in this process), or
``--runner DataflowRunner --project P --region R --temp_location gs://...`` for a corpus of terabytes (the workers
need llama_jax installed: ``--setup_file`` or a container image).
"""

from __future__ import annotations

import logging
import sys

from absl import flags

from llama_jax import cli
from llama_jax.core.errors import exit_with_error, run_or_exit
from llama_jax.data.tokenizer_files import load_tokenizer_path

try:
  from llama_jax.data import pipeline
except ModuleNotFoundError as e:  # Apache Beam is the `beam` extra's: without it, one line saying so
  if e.name is None or not e.name.startswith("apache_beam"):
    raise
  pipeline = None


def _quiet_logging() -> None:
  """Progress on stdout, and stderr kept for the one-line error: Beam logs through the root logger (its default
  runner at INFO) and its job service relays each worker's warnings; only their errors are kept."""
  progress = logging.getLogger("llama_jax")
  progress.setLevel(logging.INFO)
  progress.addHandler(logging.StreamHandler(sys.stdout))
  progress.propagate = False
  logging.getLogger().setLevel(logging.WARNING)
  for noisy in ("absl", "gcsfs", "fsspec", "apache_beam"):
    logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv=None) -> None:
  config_flag = cli.define_config_flag(argv, "configs/tpu_v4.py")
  out_flag = flags.DEFINE_string("out", None, "directory (local or gs://) to write the shards and index.json to")
  flags.mark_flags_as_required(["out"])

  def run(argv_left):
    _quiet_logging()
    if pipeline is None:
      exit_with_error('prepare needs Apache Beam, which is not installed: pip install -e ".[beam]"')
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    data_cfg = run_config.data
    if data_cfg.format != "text":
      exit_with_error(f"prepare is for pretraining text (data.format='text'); got data.format={data_cfg.format!r}")
    if not data_cfg.tokenizer:
      exit_with_error(
        "prepare needs data.tokenizer (a .model file, a tokenizer.json or a tokenizer directory): "
        "--config.data.tokenizer=PATH"
      )
    tokenizer = run_or_exit(load_tokenizer_path, data_cfg.tokenizer)
    index, prepared = run_or_exit(pipeline.prepare, run_config, out_flag.value, tokenizer, argv_left[1:])
    splits = ", ".join(
      f"{split} {s['tokens']:,} tokens in {s['documents']:,} documents ({s['shards']} shards)"
      for split, s in index["splits"].items()
    )
    skipped = f"; skipped {index['skipped']:,} bad, the first: {index['problems'][0]}" if index["skipped"] else ""
    print(
      f"prepared {prepared} of {index['files']} files ({index['files'] - prepared} already done) into "
      f"{out_flag.value}: {splits}{skipped}"
    )

  cli.run_absl_command(run, argv, (config_flag, out_flag), known_only=True)


if __name__ == "__main__":
  main()
