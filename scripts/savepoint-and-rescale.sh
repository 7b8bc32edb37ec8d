#!/usr/bin/env bash
# Savepoint the example job (scripts/user_totals.py) and restart it at another parallelism.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/savepoint-and-rescale.sh JOB_DIR --parallelism P [options] [-- JOB_ARGS...]

Takes a savepoint of the example job whose checkpoints are in JOB_DIR
(<checkpoint-dir>/<job-id>; a path, file://, s3://, ...) and prints the command that
restarts the job from it at parallelism P (keyed state and source offsets rescaled).

  --running            the job is running: ask it for a savepoint (savepoint trigger --wait);
                       default: save its newest state, JOB_DIR/latest (savepoint create:
                       the newest batch manifest folded, or the newest checkpoint)
  --wait SECONDS       with --running: how long to wait for the job (default 300)
  --to DIR             where the savepoint goes (default: JOB_DIR/savepoints/...)
  --input DIR          the job's input (default: the source directory the job recorded)
  --storage-option K=V an fsspec option for remote storage, e.g. endpoint_url=URL (repeatable)
  --run                also run the restart command (stop the old job first)
JOB_ARGS (e.g. --master 'local[4]' --batch-size 5000) are appended to the restart command.
Prints "savepoint: PATH" and "restart: COMMAND"; a non-zero exit status on any error.
EOF
}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
job_dir="" parallelism="" running=0 wait=300 target="" input="" run=0
options=() job_args=()
while (($#)); do
    case "$1" in
        --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
        -p | --parallelism) parallelism="$2"; shift 2 ;;
        --running) running=1; shift ;;
        --wait) wait="$2"; shift 2 ;;
        --to) target="$2"; shift 2 ;;
        --input) input="$2"; shift 2 ;;
        --storage-option) options+=(--storage-option "$2"); shift 2 ;;
        --run) run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; job_args=("$@"); break ;;
        -*) echo "savepoint-and-rescale: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [[ -z "$job_dir" ]] || { usage >&2; exit 2; }; job_dir="${1%/}"; shift ;;
    esac
done
if [[ -z "$job_dir" || -z "$parallelism" ]]; then usage >&2; exit 2; fi
# The restart command works from any directory: local paths in it are absolute.
[[ "$job_dir" == *://* ]] || job_dir="$(realpath -m "$job_dir")"
[[ -z "$input" ]] || input="$(realpath -m "$input")"
[[ -z "$target" || "$target" == *://* ]] || target="$(realpath -m "$target")"
scheme() { if [[ "$1" == *://* ]]; then echo "${1%%://*}"; else echo file; fi; }
if [[ -n "$target" && "$(scheme "$target")" != "$(scheme "$job_dir")" ]]; then
    echo "savepoint-and-rescale: --to $target is not on the job's storage ($job_dir)," \
        "with which the restarted job reads it: give a $(scheme "$job_dir"):// directory" >&2
    exit 2
fi

sb() { "$PYTHON" -m statebackend "$@" "${options[@]}"; }
# json_field EXPR: evaluate EXPR on the JSON document on stdin (as `d`) and print it.
json_field() { "$PYTHON" -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

if ((running)); then
    savepoint="$(sb savepoint trigger "$job_dir" ${target:+--to "$target"} --wait "$wait")"
else
    if [[ -z "$target" ]]; then
        target="$job_dir/savepoints/savepoint-rescale-$(date +%Y%m%dT%H%M%S)"
    fi
    savepoint="$(sb savepoint create --from "$job_dir/latest" --to "$target")"
fi
if [[ -z "$input" ]]; then
    input="$(sb inspect "$savepoint" --json | json_field "d['properties'].get('source', '')")"
    [[ -n "$input" ]] || { echo "savepoint-and-rescale: give --input DIR" >&2; exit 2; }
fi
echo "savepoint: $savepoint"

command=("$PYTHON" "$ROOT/scripts/user_totals.py" --input "$input"
    --checkpoint-dir "${job_dir%/*}" --job-id "${job_dir##*/}"
    --restore "$savepoint" --parallelism "$parallelism" "${options[@]}" "${job_args[@]}")
echo "restart: ${command[*]@Q}"
if ((run)); then exec "${command[@]}"; fi
