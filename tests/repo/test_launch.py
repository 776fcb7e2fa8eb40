"""launch/tpu_vm.sh and launch/gpu.sh: the commands each --dry_run prints, one-line errors for bad input, and the TPU
worker scripts (ship, run, stop) carried out for real against a fake gcloud whose one "worker" is a local directory.
No network and no gcloud: dry runs put a gcloud first on PATH that fails the test if it is ever called."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

TPU = os.path.join("launch", "tpu_vm.sh")
GPU = os.path.join("launch", "gpu.sh")
SLICE = ["--name", "llama-v4", "--zone", "us-central2-b"]
TRICKY_FLAG = "--config.data.sources=('data/my corpus',)"  # quotes, parentheses and a space must arrive intact
NASTY_FLAG = '--note=it\'s & \\ "$HOME" `id` *'  # and what shells, globs or pattern replacements would eat

# Stands in for gcloud: records each call; `tpu-vm ssh --command=X` runs X with HOME set to the fake worker's home
# (when FAKE_GCLOUD_SSH=1), and `tpu-vm scp SRC... NAME:DEST` copies into that home.
FAKE_GCLOUD = """
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_CALLS"], "a") as f:
  f.write(json.dumps(args) + "\\n")
home = os.environ["FAKE_WORKER_HOME"]
if args[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and os.environ.get("FAKE_GCLOUD_SSH") == "1":
  command = next(a[len("--command="):] for a in args if a.startswith("--command="))
  sys.exit(subprocess.run(["bash", "-c", command], env=dict(os.environ, HOME=home)).returncode)
if args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
  *sources, dest = [a for a in args[4:] if not a.startswith("--")]
  target = os.path.join(home, dest.split(":", 1)[1])
  for source in sources:
    into = os.path.join(target, os.path.basename(source)) if target.endswith("/") else target
    (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, into)
"""

# Stands in for the workers' venv python: records how it was started, then trains until SIGTERM, as the trainer does.
FAKE_TRAINER = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "0.0.fake"; exit 0; fi  # setup's version check
{ pwd; echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-}"; printf '%s\\0' "$@"; } > "$HOME/started.tmp"
mv "$HOME/started.tmp" "$HOME/started"
trap 'echo "SIGTERM: checkpoint saved"; exit 0' TERM
echo "training"
while :; do sleep 0.05; done
"""

# The worker's pip and the interpreter that setup makes the venv from: both only record how they were called.
FAKE_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $* (in $PWD)" >> "$HOME/tools.log"
"""


def launch(script, *args, env=None):
  return subprocess.run(["bash", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def no_gcloud(tmp_path):
  """An environment whose gcloud fails and leaves a mark; the test fails if anything called it."""
  bin_dir = tmp_path / "tripwire"
  bin_dir.mkdir()
  mark = tmp_path / "gcloud_was_called"
  (bin_dir / "gcloud").write_text(f"#!/bin/sh\ntouch {shlex.quote(str(mark))}\nexit 99\n")
  (bin_dir / "gcloud").chmod(0o755)
  yield dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  assert not mark.exists(), "gcloud was called"


def dry_run(env, script, command, *args):
  """The printed commands, each split as a shell would split it."""
  result = launch(script, command, "--dry_run", *args, env=env)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines and all(line.startswith("+ ") for line in lines), result.stdout
  return [shlex.split(line[2:]) for line in lines]


def remote_command(argv):
  """The bash command line a `gcloud ... ssh --command=X` runs on the workers."""
  commands = [a[len("--command=") :] for a in argv if a.startswith("--command=")]
  assert len(commands) == 1, argv
  return commands[0]


def background_command(script):
  """The words of the one `... &` command in a remote script, as bash splits them."""
  lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  words = list(lexer)
  end = words.index("&")
  start = max(i for i in range(end) if words[i] in (";", "&&", "||", "then", "else")) + 1
  return words[start:end]


def fake_venv(tmp_path):
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").write_text("#!/bin/sh\n")
  (venv / "bin" / "python").chmod(0o755)
  return str(venv)


# ---------------------------------------------------------------------------------------------------------------------
# Both scripts


@pytest.mark.parametrize("script", [TPU, GPU])
def test_script_is_valid_bash_and_executable(script):
  for path in (script, "launch/common.sh"):  # common.sh: the helpers both source
    result = subprocess.run(["bash", "-n", path], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
  assert os.access(os.path.join(ROOT, script), os.X_OK)


@pytest.mark.parametrize("script", [TPU, GPU])
def test_help_prints_usage_and_no_arguments_is_an_error(script):
  for flag in ("-h", "--help"):
    result = launch(script, flag)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {script}"), result.stdout
  result = launch(script, "run", "--help")
  assert result.returncode == 0 and result.stdout.startswith(f"usage: {script}")
  result = launch(script)
  assert result.returncode == 2 and result.stderr.startswith(f"usage: {script}")


# ---------------------------------------------------------------------------------------------------------------------
# tpu_vm.sh --dry_run


def test_tpu_create_dry_run(no_gcloud):
  [create] = dry_run(no_gcloud, TPU, "create", *SLICE)
  assert create == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    "llama-v4",
    "--accelerator-type=v4-32",
    "--version=tpu-ubuntu2204-base",
    "--zone=us-central2-b",
  ]
  [create] = dry_run(
    no_gcloud, TPU, "create", *SLICE, "--accelerator_type", "v5litepod-16", "--spot", "--project", "my-project"
  )
  assert create == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    "llama-v4",
    "--accelerator-type=v5litepod-16",
    "--version=v2-alpha-tpuv5-lite",
    "--spot",
    "--zone=us-central2-b",
    "--project=my-project",
  ]
  [create] = dry_run(no_gcloud, TPU, "create", *SLICE, "--accelerator_type=v6e-8", "--runtime_version=my-image")
  assert "--accelerator-type=v6e-8" in create and "--version=my-image" in create


def test_tpu_create_and_delete_queued_dry_run(no_gcloud):
  [create] = dry_run(no_gcloud, TPU, "create", *SLICE, "--queued", "--spot")
  assert create == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "llama-v4",
    "--node-id=llama-v4",
    "--accelerator-type=v4-32",
    "--runtime-version=tpu-ubuntu2204-base",
    "--spot",
    "--zone=us-central2-b",
  ]
  [delete] = dry_run(no_gcloud, TPU, "delete", *SLICE, "--queued")
  assert delete == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "delete",
    "llama-v4",
    "--force",
    "--zone=us-central2-b",
  ]
  [delete] = dry_run(no_gcloud, TPU, "delete", *SLICE)
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "llama-v4", "--zone=us-central2-b"]


def test_tpu_setup_dry_run_ships_the_checkout_and_installs_the_tpu_extra_on_every_worker(no_gcloud):
  read_tree, add, archive, scp, ssh = dry_run(no_gcloud, TPU, "setup", *SLICE)
  index = add[1].split("=", 1)[1]
  assert read_tree == ["env", f"GIT_INDEX_FILE={index}", "git", "-C", ROOT, "read-tree", "HEAD"]
  assert add == ["env", f"GIT_INDEX_FILE={index}", "git", "-C", ROOT, "add", "--all"]
  tarball = archive[archive.index("-o") + 1]
  assert archive[:6] == ["git", "-C", ROOT, "archive", "--format=tar.gz", "-o"]
  assert archive[-1] == f"$(env GIT_INDEX_FILE={index} git -C {ROOT} write-tree)"
  assert scp == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "scp",
    tarball,
    "llama-v4:llama_jax.tar.gz",
    "--worker=all",
    "--zone=us-central2-b",
  ]
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "llama-v4"] and "--worker=all" in ssh
  script = remote_command(ssh)
  for step in (
    'tar -xzf ~/llama_jax.tar.gz -C "$code"',
    'python3.11 -m venv "$venv"',
    'cd "$code"; "$venv/bin/pip" install -q -e ".[tpu]"',
  ):
    assert step in script
  [*_, ssh] = dry_run(no_gcloud, TPU, "setup", *SLICE, "--python", "python3.12")
  assert "install -y python3.12 python3.12-venv" in remote_command(ssh)


def test_tpu_copy_dry_run(no_gcloud):
  mkdir, scp = dry_run(no_gcloud, TPU, "copy", *SLICE, "README.md", "configs")
  assert remote_command(mkdir) == "mkdir -p ~/llama_jax/data" and "--worker=all" in mkdir
  assert scp == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "scp",
    "--recurse",
    "README.md",
    "configs",
    "llama-v4:llama_jax/data/",
    "--worker=all",
    "--zone=us-central2-b",
  ]


def test_tpu_run_dry_run_starts_the_same_train_command_on_every_worker(no_gcloud):
  [ssh] = dry_run(
    no_gcloud,
    TPU,
    "run",
    *SLICE,
    "--config",
    "configs/tpu_v4.py",
    "--workdir",
    "gs://bucket/llama2_7b",
    "--",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
  )
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "llama-v4"] and "--worker=all" in ssh
  script = remote_command(ssh)
  assert "code=~/llama_jax; venv=~/llama_jax_venv; logs=~/llama_jax_logs;" in script
  assert '; set -e; cd "$code"; ' in script
  assert background_command(script) == [
    "PYTHONUNBUFFERED=1",
    "nohup",
    "$venv/bin/python",
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tpu_v4.py",
    "--workdir",
    "gs://bucket/llama2_7b",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
    ">>",
    "$logs/train.log",
    "2",
    ">&",
    "1",
    "<",
    "/dev/null",
  ]
  # A config given by its absolute path runs by its path inside the shipped checkout.
  [ssh] = dry_run(
    no_gcloud,
    TPU,
    "run",
    *SLICE,
    "--config",
    os.path.join(ROOT, "configs", "tpu_v4.py"),
    "--workdir",
    "gs://bucket/run",
  )
  assert background_command(remote_command(ssh))[3:9] == [
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tpu_v4.py",
    "--workdir",
    "gs://bucket/run",
  ]


def test_tpu_logs_and_stop_dry_run(no_gcloud):
  [logs] = dry_run(no_gcloud, TPU, "logs", *SLICE)
  assert "--worker=0" in logs and remote_command(logs) == "tail -n 100 -F ~/llama_jax_logs/train.log"
  [logs] = dry_run(no_gcloud, TPU, "logs", *SLICE, "--worker", "3")
  assert "--worker=3" in logs
  [stop] = dry_run(no_gcloud, TPU, "stop", *SLICE)
  script = remote_command(stop)
  assert "--worker=all" in stop and 'kill -TERM "$pid"' in script and "KILL" not in script and "-9" not in script


@pytest.mark.parametrize(
  "args, message",
  [
    (["frobnicate", *SLICE], "unknown command 'frobnicate'"),
    (["run", *SLICE, "--nmae", "x"], "unknown option '--nmae'"),
    (["create", "--zone", "us-central2-b"], "--name is required"),
    (["create", "--name", "llama-v4"], "--zone is required"),
    (["create", "--name", "Llama_V4", "--zone", "us-central2-b"], "'Llama_V4'"),
    (["create", "--name", "llama-v4", "--zone", "central"], "'central'"),
    (["create", *SLICE, "--accelerator_type", "v4"], "'v4'"),
    (["create", *SLICE, "--accelerator_type", "v9z-8"], "no default --runtime_version for --accelerator_type 'v9z-8'"),
    (["run", *SLICE, "--workdir", "gs://b/r"], "--config is required"),
    (["run", *SLICE, "--config", "configs/tpu_v4.py"], "--workdir is required"),
    (["run", *SLICE, "--config", "configs/no_such.py", "--workdir", "gs://b/r"], "'configs/no_such.py' does not exist"),
    (["run", *SLICE, "--config", "/etc/hostname", "--workdir", "gs://b/r"], "'/etc/hostname' is outside --repo_dir"),
    (["run", *SLICE, "--config", "configs/tpu_v4.py", "--workdir"], "--workdir needs a value"),
    (["setup", *SLICE, "--repo_dir", "/"], "--repo_dir '/' is not a git checkout"),
    (["setup", *SLICE, "--python", "/usr/bin/python3"], "'/usr/bin/python3'"),
    (["copy", *SLICE, "no_such_file"], "'no_such_file' does not exist"),
    (["copy", *SLICE], "copy needs at least one local PATH"),
    (["logs", *SLICE, "--worker", "first"], "'first'"),
    (["stop", *SLICE, "stray"], "unexpected argument 'stray'"),
    (["stop", *SLICE, "--", "--config.train.steps=1"], "'--config.train.steps=1'"),
  ],
)
def test_tpu_bad_input_is_one_line_error_with_exit_2(no_gcloud, args, message):
  result = launch(TPU, *args, env=no_gcloud)
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
  assert message in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# gpu.sh


def test_gpu_setup_dry_run(no_gcloud, tmp_path):
  venv = str(tmp_path / "venv")
  commands = dry_run(no_gcloud, GPU, "setup", "--venv", venv, "--python", sys.executable)
  assert commands == [
    [sys.executable, "-m", "venv", venv],
    [f"{venv}/bin/pip", "install", "-q", "--upgrade", "pip"],
    [f"{venv}/bin/pip", "install", "-e", f"{ROOT}[gpu]"],
  ]


def test_gpu_run_dry_run_one_node_is_one_process_without_coordinator(no_gcloud, tmp_path):
  venv = fake_venv(tmp_path)
  [train] = dry_run(
    no_gcloud,
    GPU,
    "run",
    "--config",
    "configs/tiny.py",
    "--workdir",
    "runs/x",
    "--venv",
    venv,
    "--",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
  )
  assert train == [
    f"{venv}/bin/python",
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tiny.py",
    "--workdir",
    "runs/x",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
  ]


@pytest.mark.parametrize("rank", [0, 1])
def test_gpu_run_dry_run_two_nodes_pass_the_coordinator_flags(no_gcloud, tmp_path, rank):
  venv = fake_venv(tmp_path)
  [train] = dry_run(
    no_gcloud,
    GPU,
    "run",
    "--config",
    "configs/tiny.py",
    "--workdir",
    "gs://b/run",
    "--venv",
    venv,
    "--nodes",
    "2",
    f"--node_rank={rank}",
    "--coordinator",
    "10.0.0.1:12355",
    "--",
    "--config.train.steps=10",
  )
  assert train == [
    f"{venv}/bin/python",
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tiny.py",
    "--workdir",
    "gs://b/run",
    "--coordinator_address",
    "10.0.0.1:12355",
    "--num_processes",
    "2",
    "--process_id",
    str(rank),
    "--config.train.steps=10",
  ]


def test_gpu_run_becomes_the_train_command(tmp_path):
  venv = fake_venv(tmp_path)
  (tmp_path / "venv" / "bin" / "python").write_text(
    f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps([os.getpid(), sys.argv[1:]]))\n"
  )
  result = subprocess.run(
    [
      "bash",
      "-c",
      f'echo $$; exec bash {GPU} "$@"',
      "gpu.sh",
      "run",
      "--config",
      "configs/tiny.py",
      "--workdir",
      "runs/x",
      "--venv",
      venv,
      "--",
      TRICKY_FLAG,
      NASTY_FLAG,
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 0, result.stderr
  shell_pid, (python_pid, argv) = int(result.stdout.split()[0]), json.loads(result.stdout.split("\n", 1)[1])
  assert python_pid == shell_pid  # exec'd: a SIGTERM sent to the launcher reaches the trainer
  assert argv == [
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tiny.py",
    "--workdir",
    "runs/x",
    TRICKY_FLAG,
    NASTY_FLAG,
  ]


def test_gpu_setup_refuses_a_python_older_than_jax_needs(no_gcloud, tmp_path):
  old_python = tmp_path / "python3.10"
  old_python.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.10.12; exit 0;; esac\nexit 1\n')
  old_python.chmod(0o755)
  result = launch(GPU, "setup", "--python", str(old_python), "--venv", str(tmp_path / "venv"), env=no_gcloud)
  assert result.returncode == 2 and result.stdout == ""
  assert (
    result.stderr == f"error: --python '{old_python}' is Python 3.10.12; jax needs >= 3.11: pass --python "
    "python3.11 (or newer)\n"
  )
  assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize(
  "args, message",
  [
    (["train"], "unknown command 'train'"),
    (["run", "--gpus", "8"], "unknown option '--gpus'"),
    (["run", "--workdir", "runs/x"], "--config is required"),
    (["run", "--config", "configs/tiny.py"], "--workdir is required"),
    (["run", "--config", "configs/no_such.py", "--workdir", "runs/x"], "'configs/no_such.py' does not exist"),
    (["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--nodes", "0"], "got '0'"),
    (
      [
        "run",
        "--config",
        "configs/tiny.py",
        "--workdir",
        "runs/x",
        "--nodes",
        "2",
        "--node_rank",
        "2",
        "--coordinator",
        "h:1",
      ],
      "--node_rank must be in [0, 2) for --nodes 2, got '2'",
    ),
    (["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--node_rank", "-1"], "got '-1'"),
    (
      ["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--nodes", "2", "--node_rank", "1"],
      "--coordinator HOST:PORT is required with --nodes 2",
    ),
    (
      ["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--nodes", "2", "--coordinator", "10.0.0.1"],
      "got '10.0.0.1'",
    ),
    (
      ["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--nodes", "2", "--coordinator", "h:70000"],
      "got 'h:70000'",
    ),
    (
      ["run", "--config", "configs/tiny.py", "--workdir", "runs/x", "--venv", "/no/such/venv"],
      "--venv '/no/such/venv' has no bin/python",
    ),
    (["setup", "--python", "no-such-python"], "--python 'no-such-python' not found"),
    (["setup", "stray"], "unexpected argument 'stray'"),
  ],
)
def test_gpu_bad_input_is_one_line_error_with_exit_2(no_gcloud, args, message):
  result = launch(GPU, *args, env=no_gcloud)
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
  assert message in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# tpu_vm.sh for real, against a fake gcloud and one local "worker"


@pytest.fixture
def fake_slice(tmp_path):
  """(env, worker home, calls file): gcloud on PATH is FAKE_GCLOUD; the worker's venv python is FAKE_TRAINER."""
  bin_dir, home = tmp_path / "bin", tmp_path / "worker"
  bin_dir.mkdir()
  (home / "llama_jax").mkdir(parents=True)
  (home / "llama_jax_venv" / "bin").mkdir(parents=True)  # as setup leaves it (made by `python3.11 -m venv`)
  venv_bin = home / "llama_jax_venv" / "bin"
  (bin_dir / "gcloud").write_text(f"#!{sys.executable}\n{FAKE_GCLOUD}")
  (bin_dir / "sudo").write_text("#!/bin/sh\necho 'the test must not reach sudo' >&2\nexit 97\n")
  (bin_dir / "python3.11").write_text(FAKE_TOOL)
  (venv_bin / "pip").write_text(FAKE_TOOL)
  (venv_bin / "python").write_text(FAKE_TRAINER)
  for path in (bin_dir / "gcloud", bin_dir / "sudo", bin_dir / "python3.11", venv_bin / "pip", venv_bin / "python"):
    path.chmod(0o755)
  calls = tmp_path / "calls.jsonl"
  env = dict(
    os.environ,
    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    FAKE_GCLOUD_CALLS=str(calls),
    FAKE_WORKER_HOME=str(home),
  )
  yield env, home, calls
  pid_file = home / "llama_jax_logs" / "train.pid"
  if pid_file.exists():  # a failed test may leave its fake trainer running
    pid = int(pid_file.read_text())
    try:
      if b"llama_jax.train" in open(f"/proc/{pid}/cmdline", "rb").read():
        os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


def test_tpu_setup_ships_the_working_tree_as_it_is(fake_slice, tmp_path):
  env, home, calls = fake_slice
  repo = tmp_path / "repo"
  repo.mkdir()

  def git(*args):
    return subprocess.run(
      ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
      check=True,
      capture_output=True,
      text=True,
    ).stdout

  git("init", "-q")
  (repo / ".gitignore").write_text("runs/\n*.model\n")
  (repo / "kept.py").write_text("committed\n")
  (repo / "deleted.py").write_text("committed\n")
  (repo / "forced.model").write_text("ignored but tracked\n")
  git("add", "-A")
  git("add", "-f", "forced.model")
  git("commit", "-q", "-m", "first")
  (repo / "kept.py").write_text("edited, not committed\n")
  (repo / "deleted.py").unlink()
  (repo / "configs").mkdir()
  (repo / "configs" / "new.py").write_text("untracked\n")
  (repo / "runs").mkdir()
  (repo / "runs" / "big.bin").write_text("ignored\n")
  status = git("status", "--porcelain")

  result = launch(TPU, "setup", *SLICE, "--repo_dir", str(repo), env=dict(env, FAKE_GCLOUD_SSH="1"))
  assert result.returncode == 0, result.stderr
  assert git("status", "--porcelain") == status  # the user's index is untouched
  code = home / "llama_jax"
  files = {str(p.relative_to(code)): p.read_text() for p in code.rglob("*") if p.is_file()}
  assert files == {
    ".gitignore": "runs/\n*.model\n",
    "kept.py": "edited, not committed\n",
    "forced.model": "ignored but tracked\n",
    "configs/new.py": "untracked\n",
  }
  assert not (home / "llama_jax.tar.gz").exists()
  assert (home / "tools.log").read_text().splitlines() == [  # python3.11 has ensurepip, so no apt-get
    f"python3.11 -c import ensurepip (in {ROOT})",
    f"pip install -q --upgrade pip (in {ROOT})",
    f"pip install -q -e .[tpu] (in {code})",
  ]
  assert "setup done on" in result.stdout and "jax 0.0.fake" in result.stdout
  calls = [json.loads(line) for line in calls.read_text().splitlines()]
  assert [c[3] for c in calls] == ["scp", "ssh"] and all("--worker=all" in c for c in calls)


def test_tpu_run_and_stop_on_a_worker(fake_slice):
  env, home, _ = fake_slice
  env = dict(env, FAKE_GCLOUD_SSH="1")
  run_args = [
    "run",
    *SLICE,
    "--config",
    "configs/tpu_v4.py",
    "--workdir",
    "gs://bucket/llama2_7b",
    "--",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
  ]
  result = launch(TPU, *run_args, env=env)
  assert result.returncode == 0, result.stderr
  assert "trainer started on" in result.stdout

  started = home / "started"
  deadline = time.monotonic() + 20
  while not started.exists() and time.monotonic() < deadline:  # the trainer starts in the background
    time.sleep(0.05)
  cwd, unbuffered, argv = started.read_text().split("\n", 2)
  assert cwd == str(home / "llama_jax") and unbuffered == "PYTHONUNBUFFERED=1"
  assert argv.split("\0")[:-1] == [
    "-m",
    "llama_jax.train",
    "--config",
    "configs/tpu_v4.py",
    "--workdir",
    "gs://bucket/llama2_7b",
    "--config.train.steps=10",
    TRICKY_FLAG,
    NASTY_FLAG,
  ]

  again = launch(TPU, *run_args, env=env)
  assert again.returncode != 0 and "a trainer is already running" in again.stderr

  stop = launch(TPU, "stop", *SLICE, env=env)
  assert stop.returncode == 0, stop.stderr
  assert "SIGTERM sent to trainer pid" in stop.stdout and "trainer stopped on" in stop.stdout
  log = (home / "llama_jax_logs" / "train.log").read_text()
  assert log.startswith("=== ") and "training\nSIGTERM: checkpoint saved\n" in log
  assert "no trainer running" in launch(TPU, "stop", *SLICE, env=env).stdout
