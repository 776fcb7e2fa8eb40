#!/usr/bin/env bash
# Installs llama_jax with CUDA 12 jax into a venv, and runs training on one GPU node or on each node of several.
# One process per node sees all of the node's GPUs; several nodes join one JAX job through a coordinator.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO_DIR=$(dirname "$SCRIPT_DIR")
readonly SCRIPT_DIR REPO_DIR
readonly VALUE_OPTIONS=" --python --venv --config --workdir --nodes --node_rank --coordinator "

usage() {
  cat <<'EOF'
usage: launch/gpu.sh setup [--python PY] [--venv DIR] [--dry_run]
       launch/gpu.sh run --config FILE --workdir DIR [--nodes N --node_rank R --coordinator HOST:PORT]
                         [--venv DIR] [--dry_run] [-- TRAIN_FLAGS...]

commands:
  setup   create the venv (if missing) and pip install -e "<repo>[gpu]" into it (jax with CUDA 12)
  run     python -m llama_jax.train --config FILE --workdir DIR TRAIN_FLAGS, in the foreground, one process that
          uses every local GPU; with --nodes N > 1, run it once on each node, each with its own --node_rank, and it
          adds --coordinator_address HOST:PORT --num_processes N --process_id R. Rerun the same command to resume.

options:
  --python PY              setup: interpreter the venv is made from (default python3; jax needs Python >= 3.11)
  --venv DIR               the venv (default: .venv in the repo holding this script)
  --config FILE            run: run config, e.g. configs/gpu_h100x8.py                                required
  --workdir DIR            run: run directory; with several nodes, one all of them see (gs:// or shared)  required
  --nodes N                run: number of nodes, one process each (default 1)
  --node_rank R            run: this node's rank, 0 .. N-1 (default 0); node 0 hosts the coordinator
  --coordinator HOST:PORT  run: node 0's address and a free port, the same on every node; required when N > 1
  --dry_run                print the commands, one per line prefixed by "+ ", and run nothing
  -h, --help               print this text
  -- TRAIN_FLAGS...        run: more flags for llama_jax.train, e.g. --config.train.steps=1000

examples:
  launch/gpu.sh setup
  launch/gpu.sh run --config configs/gpu_h100x8.py --workdir runs/llama2_7b

  # two nodes by hand: the same command on each, node_rank 0 on the node whose address is the coordinator's
  # (dcn_data=2: the config's 8-way FSDP stays inside a node, the data axis spans the two)
  launch/gpu.sh run --config configs/gpu_h100x8.py --workdir /shared/runs/llama2_7b \
      --nodes 2 --node_rank 0 --coordinator 10.0.0.1:12355 -- --config.mesh.dcn_data=2   # on 10.0.0.1
  launch/gpu.sh run --config configs/gpu_h100x8.py --workdir /shared/runs/llama2_7b \
      --nodes 2 --node_rank 1 --coordinator 10.0.0.1:12355 -- --config.mesh.dcn_data=2   # on the other node

  # two nodes under SLURM: one task per node, rank and coordinator from SLURM's variables
  srun --nodes=2 --ntasks-per-node=1 bash -c 'launch/gpu.sh run --config configs/gpu_h100x8.py \
      --workdir /shared/runs/llama2_7b --nodes "$SLURM_NTASKS" --node_rank "$SLURM_PROCID" \
      --coordinator "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):12355" -- --config.mesh.dcn_data=2'
EOF
}

# shellcheck source=launch/common.sh
source "$SCRIPT_DIR/common.sh"

# --- arguments --------------------------------------------------------------------------------------------------------

subcommand=${1:-}
case $subcommand in
  -h | --help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  setup | run) shift ;;
  -*) die "the command comes first: launch/gpu.sh setup|run [options]; got '$subcommand'" ;;
  *) die "unknown command '$subcommand'; commands: setup run" ;;
esac

python="python3" venv="$REPO_DIR/.venv" config="" workdir="" nodes="1" node_rank="0" coordinator="" dry_run=0
positionals=() train_flags=()
parse_options "$@"
((${#positionals[@]} == 0)) || die "unexpected argument '${positionals[0]}' (train flags go after --)"
if [[ $subcommand != run && ${#train_flags[@]} -gt 0 ]]; then
  die "train flags after -- only apply to run, got '${train_flags[0]}'"
fi

# --- commands ---------------------------------------------------------------------------------------------------------

cmd_setup() {
  command -v "$python" >/dev/null || die "--python '$python' not found"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    die "--python '$python' is Python $("$python" -c 'import platform; print(platform.python_version())');" \
        "jax needs >= 3.11: pass --python python3.11 (or newer)"
  fi
  if [[ ! -x $venv/bin/python ]]; then
    run_command "$python" -m venv "$venv"
  fi
  run_command "$venv/bin/pip" install -q --upgrade pip
  run_command "$venv/bin/pip" install -e "${REPO_DIR}[gpu]"
}

cmd_run() {
  [[ -n $config ]] || die "--config is required for run (e.g. configs/gpu_h100x8.py)"
  [[ -n $workdir ]] || die "--workdir is required for run"
  [[ -f $config ]] || die "--config '$config' does not exist"
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes must be an integer >= 1, got '$nodes'"
  [[ $node_rank =~ ^(0|[1-9][0-9]*)$ && $node_rank -lt $nodes ]] \
    || die "--node_rank must be in [0, $nodes) for --nodes $nodes, got '$node_rank'"
  local distributed=()
  if ((nodes > 1)); then
    [[ -n $coordinator ]] || die "--coordinator HOST:PORT is required with --nodes $nodes (node 0's address)"
    [[ $coordinator =~ ^[^:[:space:]]+:([1-9][0-9]{0,4})$ && ${BASH_REMATCH[1]} -le 65535 ]] \
      || die "--coordinator must be HOST:PORT with a port in [1, 65535], got '$coordinator'"
    distributed=(--coordinator_address "$coordinator" --num_processes "$nodes" --process_id "$node_rank")
  fi
  [[ -x $venv/bin/python ]] || die "--venv '$venv' has no bin/python; run launch/gpu.sh setup first (or pass --venv)"
  local train_command=("$venv/bin/python" -m llama_jax.train --config "$config" --workdir "$workdir"
                       ${distributed[@]+"${distributed[@]}"} ${train_flags[@]+"${train_flags[@]}"})
  show_command "${train_command[@]}"
  if ((!dry_run)); then
    exec "${train_command[@]}"  # exec: a SIGTERM to this process (SLURM, kill) reaches the trainer, which saves
  fi
}

case $subcommand in
  setup) cmd_setup ;;
  run) cmd_run ;;
esac
