# shellcheck shell=bash disable=SC2034,SC2154  # sourced: dry_run, train_flags, positionals belong to the caller
# Helpers shared by tpu_vm.sh and gpu.sh (sourced; not a command). Needs `dry_run` set by the caller.

die() {
  echo "error: $*" >&2
  exit 2
}

# shlex.quote's rule: safe words as they are, anything else in single quotes.
quote() {
  local quote_char="'" escaped_quote="'\\''"  # pattern and replacement in variables: the same in bash 3.2 and 5
  if [[ -z $1 ]]; then
    printf "''"
  elif [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//$quote_char/$escaped_quote}"
  fi
}

quote_all() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(quote "$word")"
  done
  printf '%s' "$out"
}

# Every command goes through here: printed (stdout for --dry_run, stderr otherwise), then run unless --dry_run.
# Prints a command, shell-quoted after "+ ": to stdout for --dry_run (the output), to stderr otherwise (a log).
show_command() {
  if ((dry_run)); then
    printf '+ %s\n' "$(quote_all "$@")"
  else
    printf '+ %s\n' "$(quote_all "$@")" >&2
  fi
}

# Every command goes through here: shown, then run unless --dry_run.
run_command() {
  show_command "$@"
  if ((!dry_run)); then
    "$@"
  fi
}

# Parses options into the caller's variables: `--opt VALUE` / `--opt=VALUE` for the names in VALUE_OPTIONS set the
# variable of the same name (--node_rank → node_rank), the names in FLAG_OPTIONS (and --dry_run) set theirs to 1,
# words after `--` go to train_flags and other words to positionals. Unknown options and missing values: exit 2.
parse_options() {
  local arg
  while (($#)); do
    arg=$1
    shift
    case $arg in
      --) train_flags=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      --*=*)
        [[ $VALUE_OPTIONS == *" ${arg%%=*} "* ]] || die "unknown option '${arg%%=*}' (see --help)"
        set -- "${arg%%=*}" "${arg#*=}" "$@" ;;
      --*)
        if [[ " --dry_run ${FLAG_OPTIONS:-} " == *" $arg "* ]]; then
          printf -v "${arg#--}" '%s' 1
          continue
        fi
        [[ $VALUE_OPTIONS == *" $arg "* ]] || die "unknown option '$arg' (see --help)"
        [[ $# -gt 0 && ( $1 != --* || -z $1 ) ]] || die "$arg needs a value"
        printf -v "${arg#--}" '%s' "$1"
        shift ;;
      *) positionals+=("$arg") ;;
    esac
  done
}
