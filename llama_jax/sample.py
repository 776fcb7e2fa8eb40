"""Generate text from a checkpoint directory, or chat with it.

    python -m llama_jax.sample --checkpoint DIR --prompt TEXT [--prompt TEXT ...] [--prompt_file F]
        [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S] [--prefill_chunk N]
        [--mesh data=1,tensor=-1] [--dtype bfloat16] [--quantize int8] [--chat [--system TEXT]]

Decoding is ``inference/sampler.py``'s: a jitted prefill, then one jitted while_loop; on a mesh, weights split over
`tensor` and batch rows over `data`.
"""

from __future__ import annotations

import os
import sys

from llama_jax import cli
from llama_jax.core import distributed
from llama_jax.core.errors import FlagError, run_or_exit
from llama_jax.data.tokenization import Tokenizer
from llama_jax.inference import placement
from llama_jax.inference.console import TextStream, chat_session, interactive_turns
from llama_jax.inference.sampler import Sampler, describe_placement, load_sampler
from llama_jax.inference.sampling import SamplingConfig


def main(argv: list[str] | None = None) -> int:
  parser = cli.ArgumentParser(prog="python -m llama_jax.sample", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--checkpoint", required=True, help="llama_jax checkpoint directory (a workdir or convert output)"
  )
  parser.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
  parser.add_argument("--prompt_file", help="a file with one prompt per line")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  parser.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
  parser.add_argument("--top_p", type=float, default=0.95, help="nucleus: smallest set with this mass (1 = off)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--prefill_chunk",
    type=int,
    default=0,
    help="put prompts into the cache this many tokens per model call (0: whole); prefill memory then scales with "
    "the chunk, not the prompt",
  )
  cli.add_model_flags(parser)
  parser.add_argument(
    "--chat",
    action="store_true",
    help="multi-turn chat in the checkpoint's chat template (LLaMA 2's when it has none): turns from the "
    "terminal, or one per line of stdin when it is not a terminal",
  )
  parser.add_argument("--system", help="--chat: a system prompt")
  parser.add_argument(
    "--stream",
    choices=("auto", "yes", "no"),
    default="auto",
    help="print tokens as they come (auto: when stdout is a terminal and there is one prompt)",
  )
  args = parser.parse_args(argv)
  run_or_exit(_chat if args.chat else _complete_prompts, args)
  return 0


def _sampling(args) -> SamplingConfig:
  """The sampling flags (plain and chat), checked once."""
  sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
  if args.max_new_tokens < 1:
    raise FlagError(f"--max_new_tokens must be ≥ 1, got {args.max_new_tokens}")
  return sampling


def _read_prompts(args) -> list[str]:
  prompts = list(args.prompt)
  if args.prompt_file:
    if not os.path.isfile(args.prompt_file):
      raise FlagError(f"prompt file {args.prompt_file!r} does not exist")
    with open(args.prompt_file, encoding="utf-8") as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise FlagError("no prompt given: pass --prompt TEXT or --prompt_file F")
  for i, prompt in enumerate(prompts):
    if not prompt.strip():
      raise FlagError(f"prompt {i} is empty: prompts need some text")
  return prompts


def _load(args) -> tuple[Sampler, Tokenizer]:
  """The sampler the model flags ask for, on every device of every process (multi-host: the same command runs on
  every host)."""
  distributed.maybe_initialize_distributed()
  if args.prefill_chunk < 0:
    raise FlagError(f"--prefill_chunk must be ≥ 0 (0: the whole prompt in one call), got {args.prefill_chunk}")
  mesh = placement.decode_mesh(args.mesh)
  return load_sampler(args.checkpoint, mesh, args.dtype, args.quantize, args.step, prefill_chunk=args.prefill_chunk)


def _report(sampler: Sampler) -> None:
  """One line on stderr (process 0), once the request is checked: where the weights went."""
  if distributed.is_main_process():
    print(describe_placement(sampler), file=sys.stderr)


def _complete_prompts(args) -> None:
  """Each prompt and its continuation; one prompt on a terminal streams."""
  sampling = _sampling(args)
  prompts = _read_prompts(args)
  sampler, tokenizer = _load(args)
  encoded = [tokenizer.encode(p, bos=True) for p in prompts]
  sampler.validate(encoded, args.max_new_tokens)
  _report(sampler)
  if args.stream == "yes" or (args.stream == "auto" and sys.stdout.isatty() and len(prompts) == 1):
    printer = TextStream(tokenizer, encoded[0], set(tokenizer.stop_ids))
    sampler.generate(encoded, args.max_new_tokens, sampling, args.seed, chunk=8, on_tokens=printer)
    sys.stdout.write("\n")
    return
  outputs = sampler.generate(encoded, args.max_new_tokens, sampling, args.seed)
  if not distributed.is_main_process():
    return  # every process of a multi-host run decodes the same batch; one prints it
  for prompt_ids, output in zip(encoded, outputs):
    if len(prompts) > 1:
      print("-" * 40)
    print(tokenizer.decode(prompt_ids + output))


def _chat(args) -> None:
  """--chat: a multi-turn session, from the terminal or one turn per line of stdin."""
  sampling = _sampling(args)
  sampler, tokenizer = _load(args)
  if args.max_new_tokens >= sampler.cfg.max_seq_len:
    raise FlagError(
      f"--max_new_tokens {args.max_new_tokens} leaves no room for the conversation in "
      f"max_seq_len {sampler.cfg.max_seq_len}; use at most {sampler.cfg.max_seq_len // 2}"
    )
  _report(sampler)
  interactive = sys.stdin.isatty()
  chat_session(
    sampler,
    tokenizer,
    system=args.system,
    sampling=sampling,
    max_new_tokens=args.max_new_tokens,
    seed=args.seed,
    turns=interactive_turns() if interactive else sys.stdin,
    interactive=interactive,
  )


if __name__ == "__main__":
  sys.exit(main())
