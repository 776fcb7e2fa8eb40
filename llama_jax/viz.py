"""Pictures of a model and of its runs: attention maps, activation histograms, loss curves, loss by position, expert
load.

    python -m llama_jax.viz attention --checkpoint DIR --prompt TEXT --out DIR [--layers 0,3] [--chat]
    python -m llama_jax.viz activations --checkpoint DIR [DIR ...] --prompt TEXT --out DIR [--every K]
        [--init [CHANGES ...]]
    python -m llama_jax.viz curves RUN_DIR [RUN_DIR ...] --out curves.png [--metrics loss,val_loss] [--x step|tokens]
    python -m llama_jax.viz positions EVAL_JSON [EVAL_JSON ...] --out positions.png [--smooth N] [--mark T]
    python -m llama_jax.viz experts RUN_DIR [RUN_DIR ...] --out experts.png

Any checkpoint directory works (a training workdir, a ``convert --from_hf`` output, an SFT or LoRA workdir). The
attention probabilities and activations come from the inspection forward (``analysis/inspection.py``); the pictures
are ``analysis/figures.py``'s (matplotlib, Agg: the ``viz`` extra).
"""

from __future__ import annotations

import sys

from llama_jax import cli
from llama_jax.analysis.figures import (
  curves_figure,
  experts_figure,
  positions_figure,
  save,
  write_activations,
  write_attention,
)
from llama_jax.core.errors import run_or_exit


def main(argv: list[str] | None = None) -> int:
  parser = cli.ArgumentParser(prog="python -m llama_jax.viz", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)

  def model_command(name: str, help_text: str) -> cli.ArgumentParser:
    command = commands.add_parser(name, help=help_text, prog=f"python -m llama_jax.viz {name}")
    command.add_argument("--prompt", required=True, help="the text to run through the model")
    command.add_argument("--out", required=True, help="output directory")
    command.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    return command

  attention_cmd = model_command("attention", "attention_layer{L}.png: every head's map, query × key")
  attention_cmd.add_argument("--checkpoint", required=True, help="a llama_jax checkpoint directory")
  attention_cmd.add_argument("--layers", default="", help="comma-separated layers (default: all)")
  attention_cmd.add_argument(
    "--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template (LLaMA 2's without one)"
  )
  activations_cmd = model_command("activations", "activations.png + .json: histograms and stats across depth")
  activations_cmd.add_argument("--checkpoint", required=True, nargs="+", help="checkpoint directories")
  activations_cmd.add_argument("--every", type=int, default=1, help="histograms of every k-th layer")
  activations_cmd.add_argument(
    "--init",
    nargs="*",
    default=None,
    metavar="CHANGES",
    help="random initialisation of each checkpoint's model config, once per change set (KEY=VALUE,...; none: as is)",
  )
  activations_cmd.add_argument("--seed", type=int, default=0, help="with --init: the initialisation seed")
  curves_cmd = commands.add_parser(
    "curves", help="loss curves from metrics.jsonl", prog="python -m llama_jax.viz curves"
  )
  curves_cmd.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  curves_cmd.add_argument("--out", required=True, help="the PNG to write")
  curves_cmd.add_argument("--metrics", default="loss,val_loss", help="comma-separated metrics of metrics.jsonl")
  curves_cmd.add_argument("--x", default="step", choices=("step", "tokens"))
  positions_cmd = commands.add_parser(
    "positions", help="loss by position (evaluate --json F --by_position)", prog="python -m llama_jax.viz positions"
  )
  positions_cmd.add_argument("eval_files", nargs="+", metavar="EVAL_JSON")
  positions_cmd.add_argument("--out", required=True, help="the PNG to write")
  positions_cmd.add_argument("--smooth", type=int, default=1, help="average over this many neighbouring positions")
  positions_cmd.add_argument("--mark", type=int, default=0, help="draw a vertical line at this position")
  experts_cmd = commands.add_parser(
    "experts", help="a mixture's expert load per layer over training", prog="python -m llama_jax.viz experts"
  )
  experts_cmd.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  experts_cmd.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)

  if args.command == "attention":
    written = run_or_exit(write_attention, args.checkpoint, args.prompt, args.out, args.layers, args.chat, args.step)
  elif args.command == "activations":
    written = run_or_exit(
      write_activations, args.checkpoint, args.prompt, args.out, args.every, args.init, args.seed, args.step
    )
  elif args.command == "curves":
    metrics = [m for m in args.metrics.split(",") if m]
    fig = run_or_exit(curves_figure, args.run_dirs, metrics, args.x)
    written = [save(fig, args.out)]
  elif args.command == "experts":
    written = [save(run_or_exit(experts_figure, args.run_dirs), args.out)]
  else:
    written = [save(run_or_exit(positions_figure, args.eval_files, args.smooth, args.mark), args.out)]
  for path in written:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
