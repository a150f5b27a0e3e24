#!/usr/bin/env bash
# Write the exact versions of asyncpaged's dependencies and its dev extra (Python 3.11, Linux
# x86_64) to a lock file, with uv's resolver: the environment scripts/setup.sh installs.
#
#   bash scripts/lock.sh                      # requirements.lock, keeping its versions where allowed
#   bash scripts/lock.sh --upgrade -o FILE    # the newest releases pyproject.toml allows
#
# torch stays the CPU wheel named below (the multi-GB CUDA builds are for CUDA machines).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="torch==2.13.0+cpu"
UV=${UV:-.venv/bin/uv}
out=requirements.lock
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -o) out=$2; shift 2 ;;
    --upgrade) args+=(--upgrade); shift ;;
    *) echo "usage: $0 [--upgrade] [-o FILE]" >&2; exit 2 ;;
  esac
done
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_PIN" > "$constraints"
# uv keeps the versions already in "$out" unless --upgrade says otherwise.
args+=(--output-file "$out")
links=()
for dir in ${PIP_FIND_LINKS:-/opt/wheels}; do [[ -d "$dir" ]] && links+=(--find-links "$dir"); done
"$UV" pip compile pyproject.toml --extra dev --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 -c "$constraints" "${links[@]}" \
  --custom-compile-command "bash scripts/lock.sh" --quiet "${args[@]}"
echo "wrote $out ($(grep -c '==' "$out") pinned packages)"
