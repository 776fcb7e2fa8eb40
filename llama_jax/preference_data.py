"""Preference pairs for DPO built from shipped conversations, written as JSONL.

    python -m llama_jax.preference_data build --out pairs.jsonl [--sources chitchat ...] [--seed 0] [--context 1]

Each conversation gives one pair: its real answer chosen, another conversation's answer rejected
(``data/preference.py``'s ``build_pairs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from llama_jax import cli
from llama_jax.core.errors import run_or_exit
from llama_jax.data.preference import PAIRS_PREFIX, SHIPPED_PAIR_SOURCES, write_pairs_jsonl


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.ArgumentParser(prog="python -m llama_jax.preference_data", description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  build = commands.add_parser("build", help="write preference pairs built from shipped conversations")
  build.add_argument("--out", required=True, help="the JSONL file to write")
  build.add_argument(
    "--sources",
    nargs="+",
    default=[s[len(PAIRS_PREFIX) :] for s in SHIPPED_PAIR_SOURCES],
    help="chat sources: chitchat, chatterbot[:english,chinese], chat JSONL files",
  )
  build.add_argument("--seed", type=int, default=0)
  build.add_argument("--context", type=int, default=1, help="earlier exchanges kept before each prompt")
  args = parser.parse_args(argv)
  total = run_or_exit(write_pairs_jsonl, args.sources, args.out, seed=args.seed, context=args.context)
  print(f"wrote {total:,} preference pairs to {args.out}")


if __name__ == "__main__":
  main()
