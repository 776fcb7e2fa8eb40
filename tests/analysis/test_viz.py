"""viz.py: the inspection forward against the model itself, the pictures it draws, and loss curves from runs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matplotlib import image as mpl_image

from llama_jax import viz as viz_lib
from llama_jax.analysis import figures
from llama_jax.analysis import inspection as inspection_lib
from llama_jax.checkpoint import params as checkpoint_params
from llama_jax.core.model_config import ModelConfig
from llama_jax.model import llama as model_lib
from tests.conftest import needs_shakespeare


def tiny_config(**changes) -> ModelConfig:
  base = dict(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
  return ModelConfig(**{**base, **changes})


def random_tokens(cfg: ModelConfig, length: int = 12, seed: int = 0) -> list[int]:
  return np.random.RandomState(seed).randint(3, cfg.vocab_size, length).tolist()


@pytest.mark.parametrize(
  "changes, stacked",
  [
    (dict(), True),
    (dict(), False),
    (dict(norm="layernorm", norm_position="post", n_kv_heads=4), True),
    (dict(norm="none", n_kv_heads=1), True),
  ],
  ids=["gqa_stacked", "gqa_unstacked", "post_layernorm_mha", "no_norm_mqa"],
)
def test_inspection_forward_equals_the_model_and_gives_causal_probabilities(changes, stacked):
  cfg = tiny_config(**changes)
  model = model_lib.Llama(cfg, rngs=nnx.Rngs(3), stacked_layers=stacked)
  tokens = random_tokens(cfg)
  inspection = inspection_lib.inspect_forward(model, tokens)
  expected = np.asarray(model(jnp.asarray([tokens]))[0])
  np.testing.assert_allclose(inspection.logits_TV, expected, atol=1e-6, rtol=0)

  t = len(tokens)
  probs = inspection.attention_LNTS
  assert probs.shape == (cfg.n_layers, cfg.n_heads, t, t)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
  upper = np.triu(np.ones((t, t), dtype=bool), k=1)
  assert (probs[..., upper] == 0).all()  # exactly, not merely small
  assert (probs[..., ~upper] > 0).all()
  assert inspection.residual_LTD.shape == inspection.normed_LTD.shape == (cfg.n_layers + 1, t, cfg.dim)


def test_gqa_heads_of_one_group_see_the_same_keys():
  """Give heads 0, 1 (kv group 0) and 2 (kv group 1) the same query weights: 0 and 1 then attend identically, as
  they read the same keys, and 2 differently, as it reads other keys."""
  cfg = tiny_config(n_layers=1)  # 4 query heads over 2 kv heads: head n reads kv head n // 2
  model = model_lib.Llama(cfg, rngs=nnx.Rngs(4))
  wq = model.layers.attention.wq  # stacked [L, D, N, H]
  wq[...] = wq[...].at[:, :, 1].set(wq[:, :, 0]).at[:, :, 2].set(wq[:, :, 0])
  probs = inspection_lib.inspect_forward(model, random_tokens(cfg, 16))
  same_group, other_group = probs.attention_LNTS[0, 1], probs.attention_LNTS[0, 2]
  np.testing.assert_array_equal(same_group, probs.attention_LNTS[0, 0])
  assert np.abs(other_group - probs.attention_LNTS[0, 0]).max() > 1e-3


@pytest.fixture(scope="module")
def checkpoint_dir(small_tokenizer, tmp_path_factory):
  """A checkpoint directory (random parameters, a real 512-token tokenizer) as convert or training leaves one."""
  cfg = tiny_config()
  directory = str(tmp_path_factory.mktemp("viz") / "ckpt")
  params = nnx.to_pure_dict(nnx.state(model_lib.Llama(cfg, rngs=nnx.Rngs(5))))
  checkpoint_params.save_params_dir(directory, cfg, jax.device_get(params), tokenizer_path=small_tokenizer)
  return directory


def png_shape(path: str) -> tuple[int, int]:
  return mpl_image.imread(path).shape[:2]


@needs_shakespeare
def test_attention_pngs_are_written_with_a_head_grid_of_the_stated_size(checkpoint_dir, tmp_path, capsys):
  out = tmp_path / "attention"
  prompt = "To be, or not to be"
  assert viz_lib.main(["attention", "--checkpoint", checkpoint_dir, "--prompt", prompt, "--out", str(out)]) == 0
  written = sorted(os.listdir(out))
  assert written == ["attention_layer0.png", "attention_layer1.png"]
  n_tokens = len(inspection_lib.prompt_tokens(inspection_lib.load_model(checkpoint_dir).tokenizer, prompt))
  rows, cols, width, height = figures.attention_grid(4, n_tokens)
  assert (rows, cols) == (2, 2)
  assert png_shape(str(out / "attention_layer1.png")) == (round(height * figures.DPI), round(width * figures.DPI))

  loaded = inspection_lib.load_model(checkpoint_dir)
  inspection = inspection_lib.inspect_forward(loaded.model, inspection_lib.prompt_tokens(loaded.tokenizer, prompt))
  labels = inspection_lib.token_labels(loaded.tokenizer, inspection_lib.prompt_tokens(loaded.tokenizer, prompt))
  fig = figures.attention_figure(inspection.attention_LNTS[0], labels, 2, "layer 0")
  heads = [ax for ax in fig.axes if ax.get_title().startswith("head")]
  assert [ax.get_title() for ax in heads] == [f"head {n} · kv group {n // 2}" for n in range(4)]
  assert heads[0].get_subplotspec().get_gridspec().get_geometry() == (rows, cols)
  assert [t.get_text() for t in heads[0].get_xticklabels()] == labels
  masked = heads[0].get_images()[0].get_array()
  assert masked.mask[0, 1] and not masked.mask[1, 0]  # the upper triangle is blank, not drawn as 0

  assert (
    viz_lib.main(
      ["attention", "--checkpoint", checkpoint_dir, "--prompt", prompt, "--out", str(out), "--layers", "0,1"]
    )
    == 0
  )
  with pytest.raises(SystemExit) as exit_info:
    viz_lib.main(["attention", "--checkpoint", checkpoint_dir, "--prompt", prompt, "--out", str(out), "--layers", "2"])
  assert exit_info.value.code == 2 and "--layers 2 is outside the model's layers [0, 1]" in capsys.readouterr().err


@needs_shakespeare
def test_activations_png_and_json_for_stored_and_initialised_variants(checkpoint_dir, tmp_path):
  init = ["norm=none", "norm=layernorm,norm_position=post,n_layers=3"]
  png, report = figures.write_activations(
    [checkpoint_dir], "Now is the winter of our discontent", str(tmp_path), init=init
  )
  stats = json.loads(open(report).read())
  assert [(m["norm"], m["norm_position"]) for m in stats["models"]] == [("none", "pre"), ("layernorm", "post")]
  assert [len(m["layers"]) for m in stats["models"]] == [3, 4]  # L + 1 stream indices each
  assert set(stats["models"][0]["layers"][0]["residual"]) == {"mean", "std", "max_abs", "beyond_6_std", "non_finite"}
  for entry in stats["models"][1]["layers"][1:]:  # post-norm: the stream leaving every block is normalised
    assert abs(entry["residual"]["std"] - 1.0) < 0.05 and entry["normed"] == entry["residual"]
  rows, cols = 4, 4  # stream indices 0..3 of the deeper model, two columns per model
  assert png_shape(png) == (
    round((rows * figures.HIST_HEIGHT_INCHES + 0.4) * figures.DPI),
    round(cols * figures.HIST_WIDTH_INCHES * figures.DPI),
  )
  _, report = figures.write_activations([checkpoint_dir], "Now is the winter", str(tmp_path / "stored"))
  (stored,) = json.loads(open(report).read())["models"]
  assert stored["init"] is None and stored["name"] == "ckpt"
  for entry in stored["layers"][:2]:  # rmsnorm pre: each attention input has rms 1 (scales are 1 at init)
    assert abs(entry["normed"]["std"] - 1.0) < 0.05 and 0 <= entry["normed"]["beyond_6_std"] < 0.01


def test_activation_stats_by_hand():
  x = np.array([0.0] * 99 + [100.0])  # mean 1, std 9.95: the one value at 100 is 9.95 std away
  stats = figures.activation_stats(x)
  assert stats["mean"] == pytest.approx(1.0) and stats["max_abs"] == 100.0
  assert stats["std"] == pytest.approx(np.sqrt(99.0)) and stats["beyond_6_std"] == pytest.approx(0.01)
  assert stats["non_finite"] == 0.0
  overflowed = figures.activation_stats(np.array([1.0, 3.0, np.inf, np.nan]))  # a norm-free stack that blew up
  assert overflowed["non_finite"] == 0.5 and overflowed["mean"] == 2.0 and overflowed["max_abs"] == 3.0
  assert figures.activation_stats(np.array([np.nan]))["std"] is None


def fake_run(directory, losses, val_losses, batch_size=8, seq_len=16):
  directory.mkdir(parents=True)
  lines = [{"step": 10 * (i + 1), "loss": v, "lr": 0.1} for i, v in enumerate(losses)]
  lines += [{"step": 20 * (i + 1), "val_loss": v} for i, v in enumerate(val_losses)]
  (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
  (directory / "run_config.json").write_text(json.dumps({"train": {"batch_size": batch_size, "seq_len": seq_len}}))
  return str(directory)


def test_curves_have_one_line_per_run_and_metric(tmp_path):
  runs = [fake_run(tmp_path / "pre", [5, 4, 3, 2], [4.5, 2.5]), fake_run(tmp_path / "post", [6, 5, 5, 4], [5.0, 4.5])]
  fig = figures.curves_figure(runs, ["loss", "val_loss"])
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == ["pre: loss", "pre: val_loss", "post: loss", "post: val_loss"]
  assert list(lines[1].get_xdata()) == [20, 40] and list(lines[1].get_ydata()) == [4.5, 2.5]
  by_tokens = figures.curves_figure(runs[:1], ["loss"], x="tokens").axes[0].get_lines()
  assert len(by_tokens) == 1 and list(by_tokens[0].get_xdata()) == [1280, 2560, 3840, 5120]  # step × 8 × 16
  out = tmp_path / "curves.png"
  assert viz_lib.main(["curves", *runs, "--out", str(out), "--metrics", "loss"]) == 0 and png_shape(str(out))[0] > 0


@pytest.mark.parametrize(
  "args, message",
  [
    (["{missing}"], "has no metrics.jsonl"),
    (["{pre}", "--metrics", "loss,val_acc"], "has no metric 'val_acc' in metrics.jsonl; it has loss, lr, val_loss"),
    (["{bad}"], "metrics.jsonl:2: malformed JSON"),
    (["{pre}", "--x", "epoch"], "argument --x: invalid choice: 'epoch'"),
    (["{pre}", "--x", "tokens"], "--x tokens needs the run's batch_size and seq_len"),
  ],
  ids=["missing_file", "unknown_metric", "malformed_line", "bad_x", "tokens_without_run_config"],
)
def test_curves_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
  runs = {"pre": fake_run(tmp_path / "pre", [3, 2], [2.5]), "missing": str(tmp_path / "nothing")}
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{"step": 2, "loss"\n')
  runs["bad"] = str(bad)
  if "tokens" in args:
    os.remove(tmp_path / "pre" / "run_config.json")
  with pytest.raises(SystemExit) as exit_info:
    viz_lib.main(["curves", *[a.format(**runs) for a in args], "--out", str(tmp_path / "c.png")])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and err.count("\n") == 0 and message in err, err
  assert not (tmp_path / "c.png").exists()


def test_experts_figure_has_a_panel_per_layer_and_a_line_per_expert(tmp_path, capsys):
  """moe_load/<layer>/<expert> of the train lines (what metrics.py writes for a mixture) → one panel per layer, one
  line per expert with its shares in step order; a dense run is refused in one line."""
  run = tmp_path / "moe"
  run.mkdir()
  lines = [
    {"step": step, "loss": 3.0, **{f"moe_load/{i}/{e}": (e + 1 + i + step) / 100 for i in range(2) for e in range(3)}}
    for step in (5, 10, 15)
  ]
  (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines + [{"step": 15, "val_loss": 3}]))
  fig = figures.experts_figure([str(run)])
  assert len(fig.axes) == 2
  experts = [line for line in fig.axes[1].get_lines() if len(line.get_xdata()) == 3]
  assert len(experts) == 3 and list(experts[2].get_xdata()) == [5, 10, 15]
  np.testing.assert_allclose(experts[2].get_ydata(), [(3 + 1 + s) / 100 for s in (5, 10, 15)])
  out = tmp_path / "experts.png"
  assert viz_lib.main(["experts", str(run), "--out", str(out)]) == 0 and png_shape(str(out))[0] > 0
  dense = fake_run(tmp_path / "dense", [3, 2], [2.5])
  with pytest.raises(SystemExit) as exit_info:
    viz_lib.main(["experts", dense, "--out", str(tmp_path / "x.png")])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and "logged no expert loads" in err and err.count("\n") == 0


def test_positions_figure_has_one_line_per_evaluation(tmp_path):
  paths = []
  for name, slope in (("theta10k", 0.01), ("theta500k", 0.0)):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"loss": 1.0, "loss_by_position": list(3.0 + slope * np.arange(40))}))
    paths.append(str(path))
  fig = figures.positions_figure(paths, smooth=5, mark=16)
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == ["theta10k", "theta500k", "position 16"]
  assert len(lines[0].get_xdata()) == 36 and lines[0].get_ydata()[0] == pytest.approx(3.02)
  with pytest.raises(inspection_lib.VizError, match="no loss_by_position"):
    figures.positions_figure([str(tmp_path / "absent.json")])
