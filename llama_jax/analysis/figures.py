"""Pictures of a model and of its runs, drawn with matplotlib's Agg backend (the ``viz`` extra) on ``Figure`` objects
rather than pyplot's global state, so the functions return figures that tests read: attention maps per head,
activation histograms and statistics across depth (from the inspection forward), loss curves of runs, loss by
position. ``python -m llama_jax.viz`` is the command.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from llama_jax.analysis.inspection import (
  Inspection,
  LoadedModel,
  VizError,
  check_prompt,
  inspect_forward,
  load_model,
  prompt_tokens,
  token_labels,
)
from llama_jax.core import paths

DPI = 80  # modest: the pictures under docs/ stay well below 200 KB
ATTENTION_CELL_INCHES = 0.16  # per token of a head's map, so its tick labels stay readable
MIN_HEAD_INCHES = 2.4
HIST_WIDTH_INCHES, HIST_HEIGHT_INCHES = 2.4, 1.6
BEYOND_STDS = 6.0  # activations.json: the fraction of values further than this many std from the mean


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
  path = paths.path(run_dir, paths.METRICS_FILE)  # local or gs://, as the run wrote it
  if not path.is_file():
    raise VizError(f"{run_dir!r} has no {paths.METRICS_FILE} (not a training workdir, or no step logged yet)")
  records = []
  with path.open() as f:
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
  path = paths.path(run_dir, paths.RUN_CONFIG_FILE)
  try:
    train = json.loads(path.read_text())["train"]
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
    name = paths.name(run_dir)
    for metric in metrics:
      points = [(r["step"] * scale, float(r[metric])) for r in records if metric in r]
      if not points:
        raise VizError(f"run {run_dir!r} has no metric {metric!r} in {paths.METRICS_FILE}; it has {', '.join(logged)}")
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


_LOAD_KEY = re.compile(r"moe_load/(\d+)/(\d+)")


def expert_loads(run_dir: str) -> tuple[list[int], list[int], np.ndarray]:
  """(steps, layers, loads [steps, len(layers), E]): each logged step's share of assignments per MoE block and expert
  (the train lines' moe_load/<layer>/<expert> of a mixture-of-experts run; `layers` are the blocks' indices, every
  block's or, with moe.every, every k-th block's)."""
  steps, rows, layers = [], [], []
  for record in read_metrics(run_dir):
    cells = {tuple(map(int, m.groups())): v for k, v in record.items() if (m := _LOAD_KEY.fullmatch(k))}
    if cells:
      layers = sorted({layer for layer, _ in cells})
      loads = np.zeros((len(layers), max(expert for _, expert in cells) + 1))
      for (layer, expert), value in cells.items():
        loads[layers.index(layer), expert] = value
      steps.append(record["step"])
      rows.append(loads)
  if not rows:
    raise VizError(f"run {run_dir!r} logged no expert loads (moe_load/<layer>/<expert>): not a mixture of experts")
  return steps, layers, np.stack(rows)


def experts_figure(run_dirs: Sequence[str]):
  """Expert load over training: one row of panels per run, one panel per layer, one line per expert (its share of
  the layer's assignments; the dashed line is the fair share 1/E). An expert left idle sits on the floor."""
  runs = [(paths.name(run_dir), *expert_loads(run_dir)) for run_dir in run_dirs]
  n_panels = max(len(layers) for _, _, layers, _ in runs)
  fig = _new_figure(2.6 * n_panels + 0.6, 2.3 * len(runs) + 0.4, layout="constrained")
  axes = fig.subplots(len(runs), n_panels, squeeze=False, sharey=True)
  for row, (name, steps, layers, loads) in enumerate(runs):
    n_experts = loads.shape[2]
    for panel in range(n_panels):
      ax = axes[row][panel]
      if panel < len(layers):
        for expert in range(n_experts):
          ax.plot(steps, loads[:, panel, expert], linewidth=0.9)
        ax.axhline(1 / n_experts, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{name}: layer {layers[panel]}", fontsize=8)
      ax.grid(alpha=0.3)
      if row == len(runs) - 1:
        ax.set_xlabel("step", fontsize=8)
    axes[row][0].set_ylabel("share of assignments", fontsize=8)
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


def save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=DPI)
  return path


def parse_layers(text: str, n_layers: int) -> list[int]:
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
  check_prompt(loaded, tokens)
  chosen = parse_layers(layers, loaded.model.cfg.n_layers)
  inspection = inspect_forward(loaded.model, tokens)
  labels = token_labels(loaded.tokenizer, tokens)
  written = []
  for layer in chosen:
    fig = attention_figure(
      inspection.attention_LNTS[layer],
      labels,
      loaded.model.cfg.n_kv_heads,
      f"{loaded.name}: layer {layer} attention, {len(tokens)} tokens",
    )
    written.append(save(fig, os.path.join(out_dir, f"attention_layer{layer}.png")))
  return written


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
    check_prompt(model, tokens)
    named.append((model, inspect_forward(model.model, tokens)))
    n_tokens = len(tokens)
  png = save(activations_figure([(m.name, i) for m, i in named], every), os.path.join(out_dir, "activations.png"))
  report = os.path.join(out_dir, "activations.json")
  with open(report, "w") as f:
    json.dump(activations_report(named, n_tokens), f, indent=1)
  return png, report
