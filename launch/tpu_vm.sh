#!/usr/bin/env bash
# Puts the same llama_jax command on every worker of a Cloud TPU VM slice, through gcloud's `--worker=all`.
# Every worker runs the same `python -m llama_jax.train`; JAX finds the slice's other hosts by itself.
# Bash 3.2 compatible (macOS laptops): no associative arrays, and empty arrays expanded as ${a[@]+"${a[@]}"}.
# Remote scripts are written in single quotes on purpose: their `$` and `~` expand on the workers, not here.
# shellcheck disable=SC2016
set -euo pipefail

# The start of every remote script: where things live on a worker, and whether its trainer runs. A trainer counts
# as running while the pid file names a live process whose command line is llama_jax.train, so a recycled pid of
# another program is never signalled.
readonly REMOTE_PRELUDE='code=~/llama_jax; venv=~/llama_jax_venv; logs=~/llama_jax_logs; trainer_alive() { '\
'[ -f "$logs/train.pid" ] && tr "\0" " " 2>/dev/null < "/proc/$(cat "$logs/train.pid")/cmdline" '\
'| grep -q llama_jax.train; }'
readonly COMMANDS="create setup copy run logs stop delete"
readonly FLAG_OPTIONS=" --queued --spot "
readonly VALUE_OPTIONS=" --name --zone --project --accelerator_type --runtime_version --repo_dir --python --config \
--workdir --worker "
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
readonly SCRIPT_DIR

usage() {
  cat <<'EOF'
usage: launch/tpu_vm.sh COMMAND --name NAME --zone ZONE [options] [-- TRAIN_FLAGS...]

Puts the same llama_jax command on every worker of a Cloud TPU VM slice (gcloud compute tpus tpu-vm ... --worker=all).

commands:
  create   create the slice; with --queued, a queued resource that becomes the slice when capacity is granted
  setup    ship the checkout (--repo_dir, as in its working tree: uncommitted and untracked files included, ignored
           files not) to ~/llama_jax on every worker and pip install -e ".[tpu]" into ~/llama_jax_venv
  copy     copy local files or directories (PATH... after the options) into ~/llama_jax/data/ on every worker
  run      on every worker, in the background: cd ~/llama_jax && python -m llama_jax.train --config CONFIG
           --workdir WORKDIR TRAIN_FLAGS, appending to ~/llama_jax_logs/train.log; run it again to resume
  logs     follow one worker's train.log (--worker, default 0); Ctrl-C stops following, not training
  stop     send SIGTERM to the trainer on every worker (it saves a checkpoint and exits); waits up to 10 min
  delete   delete the slice; with --queued, the queued resource and its slice

options:
  --name NAME               TPU VM name (also the queued resource's name)                     required
  --zone ZONE               e.g. us-central2-b (v4)                                           required
  --project PROJECT         default: gcloud's configured project
  --accelerator_type TYPE   create: slice type (default v4-32)
  --runtime_version IMAGE   create: TPU VM image; default by generation: v2-v4 tpu-ubuntu2204-base,
                            v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e
  --queued                  create/delete through gcloud compute tpus queued-resources (--node-id NAME)
  --spot                    create: Spot capacity (can be preempted at any time)
  --repo_dir DIR            setup, run: the local checkout (default: the repo holding this script)
  --python PY               setup: interpreter of the venv, apt-installed if missing (default python3.11;
                            jax needs Python >= 3.11)
  --config FILE             run: run config, a file inside --repo_dir (e.g. configs/tpu_v4.py)     required
  --workdir DIR             run: the run directory, one for all workers: gs://BUCKET/PATH          required
  --worker N                logs: which worker (default 0)
  --dry_run                 print the commands, one per line prefixed by "+ ", and run nothing
  -h, --help                print this text
  -- TRAIN_FLAGS...         run: more flags for llama_jax.train, e.g. --config.train.steps=1000

examples:
  launch/tpu_vm.sh create --name llama-v4 --zone us-central2-b --accelerator_type v4-32
  launch/tpu_vm.sh setup  --name llama-v4 --zone us-central2-b
  launch/tpu_vm.sh copy   --name llama-v4 --zone us-central2-b tokenizer.model corpus
  launch/tpu_vm.sh run    --name llama-v4 --zone us-central2-b --config configs/tpu_v4.py \
      --workdir gs://my-bucket/llama2_7b -- --config.data.tokenizer=data/tokenizer.model
  launch/tpu_vm.sh logs   --name llama-v4 --zone us-central2-b
  launch/tpu_vm.sh stop   --name llama-v4 --zone us-central2-b
  launch/tpu_vm.sh delete --name llama-v4 --zone us-central2-b
EOF
}

# shellcheck source=launch/common.sh
source "$SCRIPT_DIR/common.sh"

gcloud_tpu() {
  run_command gcloud compute tpus "$@" --zone="$zone" ${project:+"--project=$project"}
}

statements() {  # one remote command line: statements joined by "; ", except after a background `... &`
  local line="" statement
  for statement in "$@"; do
    if [[ -z $line ]]; then
      line=$statement
    elif [[ $line == *"&" ]]; then
      line+=" $statement"
    else
      line+="; $statement"
    fi
  done
  printf '%s' "$line"
}

on_workers() {  # on_workers WORKER SCRIPT: one remote bash command line on one worker or on "all"
  gcloud_tpu tpu-vm ssh "$name" --worker="$1" --command="$2"
}

default_runtime_version() {
  case $1 in
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) return 1 ;;
  esac
}

absolute_path() {  # of an existing file or directory, symlinks resolved (no `realpath` on older macOS)
  if [[ -d $1 ]]; then
    (cd "$1" && pwd -P)
  else
    printf '%s/%s' "$(cd "$(dirname "$1")" && pwd -P)" "$(basename "$1")"
  fi
}

# --- arguments --------------------------------------------------------------------------------------------------------

subcommand=${1:-}
case $subcommand in
  -h | --help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  -*) die "the command comes first: launch/tpu_vm.sh COMMAND [options], COMMAND one of: $COMMANDS; got '$subcommand'" ;;
esac
[[ " $COMMANDS " == *" $subcommand "* ]] || die "unknown command '$subcommand'; commands: $COMMANDS"
shift

name="" zone="" project="" accelerator_type="v4-32" runtime_version="" repo_dir="$(dirname "$SCRIPT_DIR")"
python="python3.11" config="" workdir="" worker="0" dry_run=0 queued=0 spot=0
positionals=() train_flags=()
parse_options "$@"

[[ -n $name ]] || die "--name is required"
[[ $name =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
  || die "--name must be lowercase letters, digits and '-', starting with a letter, got '$name'"
[[ -n $zone ]] || die "--zone is required (e.g. us-central2-b for v4)"
[[ $zone =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone must look like us-central2-b, got '$zone'"
if [[ $subcommand != copy && ${#positionals[@]} -gt 0 ]]; then
  die "unexpected argument '${positionals[0]}' (only copy takes paths; train flags go after --)"
fi
if [[ $subcommand != run && ${#train_flags[@]} -gt 0 ]]; then
  die "train flags after -- only apply to run, got '${train_flags[0]}' for $subcommand"
fi

# --- commands ---------------------------------------------------------------------------------------------------------

cmd_create() {
  [[ $accelerator_type =~ ^v[0-9]+[a-z]*-[0-9]+$ ]] \
    || die "--accelerator_type must look like v4-32, v5litepod-16, v5p-32 or v6e-16, got '$accelerator_type'"
  if [[ -z $runtime_version ]]; then
    runtime_version=$(default_runtime_version "$accelerator_type") \
      || die "no default --runtime_version for --accelerator_type '$accelerator_type'; pass one" \
             "(gcloud compute tpus versions list --zone=$zone)"
  fi
  local spot_flag=()
  ((spot)) && spot_flag=(--spot)
  if ((queued)); then
    gcloud_tpu queued-resources create "$name" --node-id="$name" --accelerator-type="$accelerator_type" \
      --runtime-version="$runtime_version" ${spot_flag[@]+"${spot_flag[@]}"}
    ((dry_run)) || echo "queued; the slice exists once 'gcloud compute tpus queued-resources describe $name" \
                        "--zone=$zone' says ACTIVE" >&2
  else
    gcloud_tpu tpu-vm create "$name" --accelerator-type="$accelerator_type" --version="$runtime_version" \
      ${spot_flag[@]+"${spot_flag[@]}"}
  fi
}

cmd_setup() {
  [[ -d $repo_dir ]] || die "--repo_dir '$repo_dir' is not a directory"
  [[ -e $repo_dir/.git ]] || die "--repo_dir '$repo_dir' is not a git checkout (setup ships its working tree)"
  [[ $python =~ ^python3\.[0-9]+$ ]] || die "--python must be an apt package name like python3.11, got '$python'"
  if ((dry_run)); then
    tmp="${TMPDIR:-/tmp}/llama_jax_launch.XXXXXX"
  else
    tmp=$(mktemp -d)  # global: the EXIT trap runs after this function has returned
    trap 'rm -rf "$tmp"' EXIT
  fi
  # The working tree as it is: a throwaway index starts from HEAD's files and takes every change, untracked files
  # included and ignored ones not (unless tracked), so the user's own index is never touched.
  local index="$tmp/index" tarball="$tmp/llama_jax.tar.gz" tree
  run_command env GIT_INDEX_FILE="$index" git -C "$repo_dir" read-tree HEAD
  run_command env GIT_INDEX_FILE="$index" git -C "$repo_dir" add --all
  if ((dry_run)); then
    printf '+ %s "$(%s)"\n' "$(quote_all git -C "$repo_dir" archive --format=tar.gz -o "$tarball")" \
      "$(quote_all env GIT_INDEX_FILE="$index" git -C "$repo_dir" write-tree)"
  else
    tree=$(env GIT_INDEX_FILE="$index" git -C "$repo_dir" write-tree)
    run_command git -C "$repo_dir" archive --format=tar.gz -o "$tarball" "$tree"
  fi
  gcloud_tpu tpu-vm scp "$tarball" "$name:llama_jax.tar.gz" --worker=all
  local py
  py=$(quote "$python")
  # Unpacked over the previous code (files deleted locally stay), so a workdir or data/ under ~/llama_jax survives.
  on_workers all "$(statements "$REMOTE_PRELUDE" 'set -e' 'mkdir -p "$code"' 'tar -xzf ~/llama_jax.tar.gz -C "$code"' \
    'rm ~/llama_jax.tar.gz' \
    "if ! $py -c 'import ensurepip' 2>/dev/null; then sudo apt-get -qq update; sudo DEBIAN_FRONTEND=noninteractive \
apt-get -qq -o DPkg::Lock::Timeout=600 install -y $py $py-venv; fi" \
    "[ -x \"\$venv/bin/python\" ] || $py -m venv \"\$venv\"" \
    '"$venv/bin/pip" install -q --upgrade pip' \
    'cd "$code"' \
    '"$venv/bin/pip" install -q -e ".[tpu]"' \
    'echo "setup done on $(hostname): jax $("$venv/bin/python" -c "import jax; print(jax.__version__)")"')"
}

cmd_copy() {
  ((${#positionals[@]})) || die "copy needs at least one local PATH after the options"
  local path
  for path in "${positionals[@]}"; do
    [[ -e $path ]] || die "'$path' does not exist"
  done
  on_workers all "mkdir -p ~/llama_jax/data"
  gcloud_tpu tpu-vm scp --recurse "${positionals[@]}" "$name:llama_jax/data/" --worker=all
}

cmd_run() {
  [[ -n $config ]] || die "--config is required for run (e.g. configs/tpu_v4.py)"
  [[ -n $workdir ]] || die "--workdir is required for run (gs://BUCKET/PATH)"
  [[ -f $config ]] || die "--config '$config' does not exist"
  [[ -d $repo_dir ]] || die "--repo_dir '$repo_dir' is not a directory"
  local repo config_path
  repo=$(absolute_path "$repo_dir")
  config_path=$(absolute_path "$config")
  [[ $config_path == "$repo"/* ]] \
    || die "--config '$config' is outside --repo_dir '$repo_dir', so setup does not ship it; put it under configs/"
  config_path=${config_path#"$repo"/}
  if [[ $workdir != *://* ]]; then
    echo "warning: --workdir '$workdir' is a path on each worker; on a multi-host slice all workers must see the" \
         "same directory: use gs://BUCKET/PATH" >&2
  fi
  local train_args
  train_args=$(quote_all --config "$config_path" --workdir "$workdir" ${train_flags[@]+"${train_flags[@]}"})
  on_workers all "$(statements "$REMOTE_PRELUDE" 'set -e' 'cd "$code"' 'mkdir -p "$logs"' \
    'if trainer_alive; then echo "error: a trainer is already running on $(hostname); stop it first" >&2; exit 1; fi' \
    "echo \"=== \$(date -u +%FT%TZ) llama_jax.train\" $train_args >> \"\$logs/train.log\"" \
    "PYTHONUNBUFFERED=1 nohup \"\$venv/bin/python\" -m llama_jax.train $train_args >> \"\$logs/train.log\" 2>&1 \
< /dev/null &" \
    'echo $! > "$logs/train.pid"' \
    'echo "trainer started on $(hostname), pid $!"')"
  ((dry_run)) || echo "follow it: launch/tpu_vm.sh logs --name $name --zone $zone${project:+ --project $project}" >&2
}

cmd_logs() {
  [[ $worker =~ ^(0|[1-9][0-9]*)$ ]] || die "--worker must be a worker index (0, 1, ...), got '$worker'"
  on_workers "$worker" 'tail -n 100 -F ~/llama_jax_logs/train.log'
}

cmd_stop() {
  on_workers all "$(statements "$REMOTE_PRELUDE" \
    'if ! trainer_alive; then echo "no trainer running on $(hostname)"; exit 0; fi' \
    'pid=$(cat "$logs/train.pid")' \
    'kill -TERM "$pid"' \
    'echo "SIGTERM sent to trainer pid $pid on $(hostname); waiting for it to save and exit"' \
    'for i in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done' \
    'if kill -0 "$pid" 2>/dev/null; then echo "trainer on $(hostname) still running after 10 min" >&2; exit 1; fi' \
    'echo "trainer stopped on $(hostname)"')"
}

cmd_delete() {
  if ((queued)); then
    gcloud_tpu queued-resources delete "$name" --force  # --force: its slice too
  else
    gcloud_tpu tpu-vm delete "$name"
  fi
}

case $subcommand in
  create) cmd_create ;;
  setup) cmd_setup ;;
  copy) cmd_copy ;;
  run) cmd_run ;;
  logs) cmd_logs ;;
  stop) cmd_stop ;;
  delete) cmd_delete ;;
esac
