"""Pictures of a model and of its runs: attention maps, activation histograms, loss curves, loss by position.

    python -m llama_jax.viz attention --checkpoint DIR --prompt TEXT --out DIR [--layers 0,3] [--chat]
    python -m llama_jax.viz activations --checkpoint DIR [DIR ...] --prompt TEXT --out DIR [--every K]
        [--init [CHANGES ...]]
    python -m llama_jax.viz curves RUN_DIR [RUN_DIR ...] --out curves.png [--metrics loss,val_loss] [--x step|tokens]
    python -m llama_jax.viz positions EVAL_JSON [EVAL_JSON ...] --out positions.png [--smooth N] [--mark T]

Any checkpoint directory works (a training workdir, a ``convert --from_hf`` output, an SFT or LoRA workdir): the
model, its tokenizer and its latest (or ``--step``) parameters are read as ``sample`` and ``evaluate`` read them.
Attention probabilities and activations come from ``inspect_forward``, a separate forward pass that calls the model's
own modules (each block's norms, projections, RoPE and MLP, the embedding and the head) and forms the attention
probabilities explicitly; the training and decoding paths keep their fused kernels and return nothing extra. Its
logits equal the model's (tested to 1e-6). Pictures are drawn with matplotlib's Agg backend (the ``viz`` extra), on
``Figure`` objects rather than pyplot's global state, so the library functions return figures that tests read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama_jax import attention as attention_lib
from llama_jax import chat, checkpoint, sharding
from llama_jax.cli import ArgumentParser
from llama_jax.config import ModelConfig
from llama_jax.errors import LlamaJaxError, run_or_exit
from llama_jax.model import Block, Llama
from llama_jax.tokenizer import TOKENIZER_FILE, Tokenizer

DPI = 80  # modest: the pictures under docs/ stay well below 200 KB
ATTENTION_CELL_INCHES = 0.16  # per token of a head's map, so its tick labels stay readable
MIN_HEAD_INCHES = 2.4
HIST_WIDTH_INCHES, HIST_HEIGHT_INCHES = 2.4, 1.6
BEYOND_STDS = 6.0  # activations.json: the fraction of values further than this many std from the mean
METRICS_FILE = "metrics.jsonl"


class VizError(LlamaJaxError, ValueError):
  """A picture cannot be made from these inputs; the message names the file, metric or value."""


# ---------------------------------------------------------------------------------------------------------------------
# The inspection forward


@dataclasses.dataclass(frozen=True)
class Inspection:
  """What one prompt does inside a model (float32 host arrays; T prompt tokens, L layers).

  logits_TV: the model's logits. attention_LNTS: each layer's attention probabilities per query head, query × key,
  exactly 0 above the diagonal (head n reads kv head n // G). residual_LTD: the residual stream entering each block,
  then (index L) the stream after the last one. normed_LTD: what reads it: each block's attention input (the
  normalised stream in a pre-norm block, the stream itself in a post-norm or norm-free one), then the LM head's input
  (after the final norm, if the model has one)."""

  logits_TV: np.ndarray
  attention_LNTS: np.ndarray
  residual_LTD: np.ndarray
  normed_LTD: np.ndarray


def blocks_of(model: Llama) -> list[Block]:
  """The model's blocks as separate modules, in order, in either layout (stacked: one slice of every parameter)."""
  if not model.stacked:
    return list(model.layers)
  graphdef, layer_state = nnx.split(model.layers)
  return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], layer_state)) for i in range(model.cfg.n_layers)]


def attention_probabilities(q_BTNH: jax.Array, k_BSKH: jax.Array) -> jax.Array:
  """Causal attention probabilities [B, N, T, S] (float32) as ``attention.xla_attention`` computes them: query heads
  grouped [K, G] over their kv head, scores in float32 scaled by 1/√H, the upper triangle masked. Masked entries are
  set to exactly 0 (the softmax leaves them at exp(-huge) = 0 in float32 already; the mask makes it a guarantee)."""
  batch, q_len, n_heads, head_dim = q_BTNH.shape
  kv_len, n_kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(batch, q_len, n_kv_heads, n_heads // n_kv_heads, head_dim)
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  scores_BKGTS = scores_BKGTS * (1.0 / np.sqrt(head_dim))
  visible_TS = jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
  probs_BKGTS = jax.nn.softmax(jnp.where(visible_TS, scores_BKGTS, attention_lib.MASK_VALUE), axis=-1)
  probs_BKGTS = jnp.where(visible_TS, probs_BKGTS, 0.0)
  return probs_BKGTS.reshape(batch, n_heads, q_len, kv_len)  # head n = k·G + g, the grouping of the [K, G] view


def _inspect_block(block: Block, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
  """(block output, attention input, attention probabilities [B, N, T, T]): the block's own forward with the
  attention kernel replaced by explicit probabilities, every other step its modules' own code."""
  attention = block.attention
  normed_BTD = block.norm_in(block.attention_norm, x_BTD)
  q_BTNH, k_BTKH, v_BTKH = attention._rotated_qkv(normed_BTD, positions_BT)
  probs_BNTS = attention_probabilities(q_BTNH, k_BTKH)
  batch, length, n_heads, head_dim = q_BTNH.shape
  n_kv_heads = k_BTKH.shape[2]
  probs_BKGTS = probs_BNTS.reshape(batch, n_kv_heads, n_heads // n_kv_heads, length, length).astype(v_BTKH.dtype)
  out_BTNH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BTKH).reshape(batch, length, n_heads, head_dim)
  h_BTD = block.norm_out(block.attention_norm, x_BTD + attention._output(out_BTNH))
  return block._mlp_residual(h_BTD), normed_BTD, probs_BNTS


def inspect_forward(model: Llama, tokens: Sequence[int]) -> Inspection:
  """Runs one prompt through `model` and keeps what happens inside (see ``Inspection``). Eager, one prompt: it is
  for looking, not for speed. One jitted call with the layers unrolled was slower for deep models (three 32-layer
  initialisations: 35.6 s against 19.4 s eager, 2 cores), its compile costing more than op-by-op dispatch."""
  tokens_BT = jnp.asarray(np.asarray(tokens, np.int32)[None])
  positions_BT = jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None]
  x_BTD = model._embed(tokens_BT)
  residuals, normed, probs = [], [], []
  for block in blocks_of(model):
    residuals.append(x_BTD)
    x_BTD, normed_BTD, probs_BNTS = _inspect_block(block, x_BTD, positions_BT)
    normed.append(normed_BTD)
    probs.append(probs_BNTS)
  residuals.append(x_BTD)
  normed.append(x_BTD if model.final_norm is None else model.final_norm(x_BTD))
  logits_BTV = model._logits(x_BTD)

  def host(arrays):
    return np.stack([np.asarray(a[0], np.float32) for a in arrays])

  return Inspection(
    logits_TV=np.asarray(logits_BTV[0], np.float32),
    attention_LNTS=host(probs),
    residual_LTD=host(residuals),
    normed_LTD=host(normed),
  )


# ---------------------------------------------------------------------------------------------------------------------
# Models and prompts


def parse_changes(text: str) -> dict[str, Any]:
  """Model-config changes from "n_layers=32,norm=none" → {"n_layers": 32, "norm": "none"}: each value read as JSON
  (numbers, true/false) where it parses, as a string otherwise. The ModelConfig they build checks names and values."""
  changes: dict[str, Any] = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise VizError(f"model change {item!r} must be KEY=VALUE (e.g. n_layers=32,norm=none)")
    try:
      changes[key.strip()] = json.loads(value)
    except json.JSONDecodeError:
      changes[key.strip()] = value.strip()
  return changes


@dataclasses.dataclass
class LoadedModel:
  name: str  # as the pictures label it
  checkpoint_dir: str
  model: Llama
  tokenizer: Tokenizer
  init: str | None  # the model-config changes of a random initialisation, None for the trained parameters


def load_model(
  checkpoint_dir: str, step: int | None = None, init: str | None = None, seed: int = 0, name: str = ""
) -> LoadedModel:
  """A checkpoint directory's model and tokenizer: its stored parameters (``checkpoint.load_params``, the latest or
  `step`, on one device; a LoRA workdir's merged), or with `init` ("" or changes such as "n_layers=32,norm=none") a
  random initialisation (seed `seed`) of its model config with those changes: the architecture before training."""
  tokenizer_path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
  cfg = checkpoint.read_model_config(checkpoint_dir)
  if not os.path.isfile(tokenizer_path):
    raise VizError(f"{checkpoint_dir!r} has no {TOKENIZER_FILE}; the pictures need its tokenizer")
  name = name or os.path.basename(os.path.normpath(checkpoint_dir))
  if init is None:
    cfg, params = checkpoint.load_params(checkpoint_dir, step=step)
    model = nnx.merge(sharding.abstract_params(Llama, cfg)[0], params)
  else:
    cfg = ModelConfig.from_dict({**cfg.to_dict(), **parse_changes(init)})
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    name = f"{name} init" + (f" ({init})" if init else "")
  return LoadedModel(name, checkpoint_dir, model, Tokenizer(tokenizer_path), init)


def prompt_tokens(tokenizer: Tokenizer, prompt: str, as_chat: bool = False) -> list[int]:
  """bos + the prompt's ids, or with `as_chat` the LLaMA 2 chat template's generation prompt for it (chat.py)."""
  if not prompt:
    raise VizError("--prompt must not be empty")
  if as_chat:
    return chat.encode_exchange(tokenizer, prompt, None)[0]
  return [tokenizer.bos_id] + tokenizer.encode(prompt)


def token_labels(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
  """Tick labels: each token's vocabulary piece (sentencepiece's "▁" marks a leading space)."""
  return [tokenizer.id_to_piece(t) for t in tokens]


def _check_prompt(loaded: LoadedModel, tokens: Sequence[int]) -> None:
  cfg = loaded.model.cfg
  if max(tokens) >= cfg.vocab_size:
    raise VizError(f"the prompt holds token id {max(tokens)}, past {loaded.name}'s vocab_size {cfg.vocab_size}")
  if len(tokens) > cfg.max_seq_len:
    raise VizError(f"the prompt is {len(tokens)} tokens, more than {loaded.name}'s max_seq_len {cfg.max_seq_len}")


# ---------------------------------------------------------------------------------------------------------------------
# Figures


def _new_figure(width: float, height: float, **kwargs):
  """A matplotlib Figure drawn by the Agg backend (no display, no pyplot state); one line when matplotlib is absent."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
  except ImportError as e:
    raise VizError(f"the pictures need matplotlib ({e}); pip install -e '.[viz]'") from e
  return Figure(figsize=(width, height), **kwargs)


def attention_grid(n_heads: int, n_tokens: int) -> tuple[int, int, float, float]:
  """(rows, cols, width, height in inches) of a layer's attention figure: the heads in a near-square grid, in head
  order (a kv group's heads side by side), each map ATTENTION_CELL_INCHES per token (at least MIN_HEAD_INCHES)."""
  cols = math.ceil(math.sqrt(n_heads))
  rows = math.ceil(n_heads / cols)
  side = max(MIN_HEAD_INCHES, ATTENTION_CELL_INCHES * n_tokens + 1.0)
  return rows, cols, cols * side + 0.8, rows * side + 0.5


def attention_figure(attention_NTS: np.ndarray, labels: Sequence[str], n_kv_heads: int, title: str):
  """One layer's heads, query (rows) × key (columns), probability 0 → 1 in one colour scale; the causal upper
  triangle is left blank (masked, not drawn as 0) and each head is labelled with its kv group."""
  n_heads, n_tokens, _ = attention_NTS.shape
  rows, cols, width, height = attention_grid(n_heads, n_tokens)
  fig = _new_figure(width, height, layout="constrained")
  fig.suptitle(title, fontsize=9)
  axes = fig.subplots(rows, cols, squeeze=False)
  upper_TS = np.triu(np.ones((n_tokens, n_tokens), dtype=bool), k=1)
  step = max(1, math.ceil(n_tokens / 48))  # past ~48 tokens every label would overlap its neighbours
  groups = n_heads // n_kv_heads
  image = None
  for head, ax in enumerate(axes.flat):
    if head >= n_heads:
      ax.set_axis_off()
      continue
    image = ax.imshow(
      np.ma.masked_array(attention_NTS[head], mask=upper_TS), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest"
    )
    ax.set_facecolor("white")
    ax.set_title(f"head {head} · kv group {head // groups}", fontsize=8)
    ticks = np.arange(0, n_tokens, step)
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=6)
    ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=6)
    ax.set_xlabel("key", fontsize=7)
    ax.set_ylabel("query", fontsize=7)
  fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="probability")
  return fig


def activation_stats(x: np.ndarray) -> dict[str, float | None]:
  """mean, std, max |x| and the fraction of values further than BEYOND_STDS std from the mean (outlier features),
  over the finite values; `non_finite` is the fraction that overflowed (a norm-free stack can blow up: inf, then
  NaN), and with no finite value the others are None (JSON has no NaN)."""
  x = np.asarray(x, np.float64).ravel()
  finite = x[np.isfinite(x)]
  non_finite = float(1.0 - finite.size / max(x.size, 1))
  if not finite.size:
    return dict(mean=None, std=None, max_abs=None, beyond_6_std=None, non_finite=non_finite)
  mean, std = float(finite.mean()), float(finite.std())
  beyond = float(np.mean(np.abs(finite - mean) > BEYOND_STDS * std)) if std > 0 else 0.0
  return dict(mean=mean, std=std, max_abs=float(np.abs(finite).max()), beyond_6_std=beyond, non_finite=non_finite)


def sampled_layers(n_layers: int, every: int) -> list[int]:
  """Stream indices 0, k, 2k, ... (entering those blocks) plus n_layers (after the last block), the seed's rows."""
  return sorted(set(range(0, n_layers, every)) | {n_layers})


def activations_figure(named: Sequence[tuple[str, Inspection]], every: int):
  """The seed's layers-by-variant grid: a row per sampled stream index, two columns per model (the residual stream
  and what reads it, see ``Inspection``), each a histogram of the values over the prompt's tokens and dimensions."""
  layers_per_model = [sampled_layers(inspection.residual_LTD.shape[0] - 1, every) for _, inspection in named]
  rows, cols = max(len(layers) for layers in layers_per_model), 2 * len(named)
  fig = _new_figure(cols * HIST_WIDTH_INCHES, rows * HIST_HEIGHT_INCHES + 0.4, layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  for m, ((name, inspection), layers) in enumerate(zip(named, layers_per_model)):
    n_layers = inspection.residual_LTD.shape[0] - 1
    for r in range(rows):
      for c, (kind, arrays) in enumerate((("residual", inspection.residual_LTD), ("normed", inspection.normed_LTD))):
        ax = axes[r, 2 * m + c]
        if r >= len(layers):
          ax.set_axis_off()
          continue
        layer = layers[r]
        stats = activation_stats(arrays[layer])
        values = arrays[layer].ravel()
        values = values[np.isfinite(values)]
        if values.size:
          ax.hist(values, bins=60, density=True, color="steelblue" if c == 0 else "darkorange", alpha=0.8)
        where = f"into block {layer}" if layer < n_layers else "after the last block"
        reader = "attention input" if layer < n_layers else "head input"
        # The model's name heads its two columns once (wrapped to the column), each panel says what it shows.
        header = textwrap.fill(name, 36) + "\n" if r == 0 else ""
        ax.set_title(f"{header}{kind if c == 0 else reader}, {where}", fontsize=7)
        note = f"std {stats['std']:.3g}" if stats["std"] is not None else "no finite value"
        if stats["non_finite"]:
          note += f"\n{stats['non_finite']:.0%} inf/NaN"
        ax.text(0.98, 0.95, note, transform=ax.transAxes, ha="right", va="top", fontsize=6)
        ax.tick_params(labelsize=6)
  return fig


def activations_report(named: Sequence[tuple[LoadedModel, Inspection]], n_tokens: int) -> dict[str, Any]:
  """activations.json: per model, per stream index (0 .. L), the stats of the residual stream and of what reads it."""
  models = []
  for loaded, inspection in named:
    cfg = loaded.model.cfg
    layers = [
      dict(
        layer=layer,
        residual=activation_stats(inspection.residual_LTD[layer]),
        normed=activation_stats(inspection.normed_LTD[layer]),
      )
      for layer in range(inspection.residual_LTD.shape[0])
    ]
    models.append(
      dict(
        name=loaded.name,
        checkpoint=loaded.checkpoint_dir,
        init=loaded.init,
        norm=cfg.norm,
        norm_position=cfg.norm_position,
        n_layers=cfg.n_layers,
        layers=layers,
      )
    )
  return dict(
    prompt_tokens=n_tokens,
    beyond_stds=BEYOND_STDS,
    note="layer l < n_layers: entering block l (normed: its attention input); layer n_layers: after the last block "
    "(normed: the LM head's input)",
    models=models,
  )


# ---------------------------------------------------------------------------------------------------------------------
# Runs: loss curves and loss by position


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The lines of a run's metrics.jsonl (train lines and ``val_`` evaluation lines), each with its step."""
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.isfile(path):
    raise VizError(f"{run_dir!r} has no {METRICS_FILE} (not a training workdir, or no step logged yet)")
  records = []
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise VizError(f"{path}:{number}: malformed JSON ({e.msg})") from e
      if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise VizError(f"{path}:{number}: a metrics line must be an object with an integer 'step'")
      records.append(record)
  return records


def _tokens_per_step(run_dir: str) -> int:
  path = os.path.join(run_dir, checkpoint.RUN_CONFIG_FILE)
  try:
    with open(path) as f:
      train = json.load(f)["train"]
    return int(train["batch_size"]) * int(train["seq_len"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise VizError(f"--x tokens needs the run's batch_size and seq_len from {path} ({e})") from e


def curves_figure(run_dirs: Sequence[str], metrics: Sequence[str] = ("loss", "val_loss"), x: str = "step"):
  """One axes, one line per run and metric, labelled "run: metric" (the run is its directory's name). x is the step
  or the tokens trained (step × batch_size × seq_len of the run's run_config.json). A metric a run never logged is
  refused, naming the ones it has."""
  if x not in ("step", "tokens"):
    raise VizError(f"--x must be step or tokens, got {x!r}")
  if not run_dirs or not metrics:
    raise VizError("curves needs at least one run directory and one metric")
  series = []
  for run_dir in run_dirs:
    records = read_metrics(run_dir)
    scale = _tokens_per_step(run_dir) if x == "tokens" else 1
    logged = sorted({k for r in records for k in r if k != "step"})
    name = os.path.basename(os.path.normpath(run_dir))
    for metric in metrics:
      points = [(r["step"] * scale, float(r[metric])) for r in records if metric in r]
      if not points:
        raise VizError(f"run {run_dir!r} has no metric {metric!r} in {METRICS_FILE}; it has {', '.join(logged)}")
      series.append((f"{name}: {metric}", points))
  fig = _new_figure(7.0, 4.2, layout="constrained")
  ax = fig.add_subplot()
  for label, points in series:
    steps, values = zip(*points)
    ax.plot(steps, values, label=label, linewidth=1.2, marker="." if len(points) < 30 else None)
  ax.set_xlabel("tokens" if x == "tokens" else "step")
  ax.set_ylabel(metrics[0] if len(metrics) == 1 else "value")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


def positions_figure(eval_paths: Sequence[str], smooth: int = 1, mark: int = 0):
  """Mean loss at each position of the evaluation windows (``evaluate --json F --by_position``), one line per file
  labelled by its name, averaged over `smooth` neighbouring positions; `mark` draws a vertical line (e.g. the
  training length)."""
  if smooth < 1:
    raise VizError(f"--smooth must be ≥ 1, got {smooth}")
  fig = _new_figure(7.0, 4.2, layout="constrained")
  ax = fig.add_subplot()
  for path in eval_paths:
    try:
      with open(path) as f:
        losses = json.load(f)["loss_by_position"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise VizError(f"{path}: no loss_by_position ({e}); write it with evaluate --json FILE --by_position") from e
    values = np.asarray(losses, np.float64)
    if smooth > 1:
      values = np.convolve(values, np.ones(smooth) / smooth, mode="valid")
    ax.plot(np.arange(len(values)) + (smooth - 1) / 2, values, label=os.path.splitext(os.path.basename(path))[0])
  if mark:
    ax.axvline(mark, color="gray", linestyle="--", linewidth=1, label=f"position {mark}")
  ax.set_xlabel("position in the window")
  ax.set_ylabel("loss (nats per token)" + (f", mean of {smooth} positions" if smooth > 1 else ""))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


# ---------------------------------------------------------------------------------------------------------------------
# Commands


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=DPI)
  return path


def _parse_layers(text: str, n_layers: int) -> list[int]:
  if not text:
    return list(range(n_layers))
  try:
    layers = [int(part) for part in text.split(",")]
  except ValueError as e:
    raise VizError(f"--layers must be comma-separated layer indices, e.g. 0,3; got {text!r}") from e
  bad = [layer for layer in layers if not 0 <= layer < n_layers]
  if bad:
    raise VizError(f"--layers {bad[0]} is outside the model's layers [0, {n_layers - 1}]")
  return layers


def write_attention(
  checkpoint_dir: str,
  prompt: str,
  out_dir: str,
  layers: str = "",
  as_chat: bool = False,
  step: int | None = None,
) -> list[str]:
  """attention_layer{L}.png for each of `layers` (default all) of the model's attention on `prompt`."""
  loaded = load_model(checkpoint_dir, step)
  tokens = prompt_tokens(loaded.tokenizer, prompt, as_chat)
  _check_prompt(loaded, tokens)
  chosen = _parse_layers(layers, loaded.model.cfg.n_layers)
  inspection = inspect_forward(loaded.model, tokens)
  labels = token_labels(loaded.tokenizer, tokens)
  paths = []
  for layer in chosen:
    fig = attention_figure(
      inspection.attention_LNTS[layer],
      labels,
      loaded.model.cfg.n_kv_heads,
      f"{loaded.name}: layer {layer} attention, {len(tokens)} tokens",
    )
    paths.append(_save(fig, os.path.join(out_dir, f"attention_layer{layer}.png")))
  return paths


def write_activations(
  checkpoint_dirs: Sequence[str],
  prompt: str,
  out_dir: str,
  every: int = 1,
  init: Sequence[str] | None = None,
  seed: int = 0,
  step: int | None = None,
) -> tuple[str, str]:
  """activations.png and activations.json for each checkpoint, or with `init` for a random initialisation of each
  checkpoint's architecture per change set (the seed's none / LayerNorm / RMSNorm comparison, e.g. init=
  ["n_layers=32,norm=none", "n_layers=32,norm=layernorm", "n_layers=32"])."""
  if every < 1:
    raise VizError(f"--every must be ≥ 1, got {every}")
  loaded = [
    load_model(directory, step, init=changes, seed=seed)
    for directory in checkpoint_dirs
    for changes in ([None] if init is None else init or [""])  # --init alone: the checkpoint's config as it is
  ]
  named, n_tokens = [], 0
  for model in loaded:
    tokens = prompt_tokens(model.tokenizer, prompt)
    _check_prompt(model, tokens)
    named.append((model, inspect_forward(model.model, tokens)))
    n_tokens = len(tokens)
  png = _save(activations_figure([(m.name, i) for m, i in named], every), os.path.join(out_dir, "activations.png"))
  report = os.path.join(out_dir, "activations.json")
  with open(report, "w") as f:
    json.dump(activations_report(named, n_tokens), f, indent=1)
  return png, report


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m llama_jax.viz", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)

  def model_command(name: str, help_text: str) -> ArgumentParser:
    command = commands.add_parser(name, help=help_text, prog=f"python -m llama_jax.viz {name}")
    command.add_argument("--prompt", required=True, help="the text to run through the model")
    command.add_argument("--out", required=True, help="output directory")
    command.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    return command

  attention_cmd = model_command("attention", "attention_layer{L}.png: every head's map, query × key")
  attention_cmd.add_argument("--checkpoint", required=True, help="a llama_jax checkpoint directory")
  attention_cmd.add_argument("--layers", default="", help="comma-separated layers (default: all)")
  attention_cmd.add_argument("--chat", action="store_true", help="wrap the prompt in the LLaMA 2 chat template")
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
    written = [_save(fig, args.out)]
  else:
    written = [_save(run_or_exit(positions_figure, args.eval_files, args.smooth, args.mark), args.out)]
  for path in written:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
