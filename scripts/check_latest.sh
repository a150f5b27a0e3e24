#!/usr/bin/env bash
# Try the newest releases pyproject.toml allows before the lock moves to them: resolve them
# (scripts/lock.sh --upgrade), install them into a scratch venv, print what moved against
# requirements.lock, and run CI's checks there (ruff, mypy, the whole test suite).
#
#   bash scripts/check_latest.sh            # check; requirements.lock is left as it is
#   bash scripts/check_latest.sh --update   # and, when everything passes, move the lock forward
#
# VENV (default /tmp/asyncpaged-latest) is made anew each run. Extra arguments after `--` go to
# pytest (e.g. `-- -x`). About as long as CI: 15-25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/asyncpaged-latest}
PYTHON=${PYTHON:-python3}
update=0
pytest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --update) update=1; shift ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "usage: $0 [--update] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
done

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" uv
latest="$VENV/latest.lock"
UV="$VENV/bin/uv" bash scripts/lock.sh --upgrade -o "$latest"

echo "== what moved against requirements.lock"
pins() { grep -E '^[A-Za-z0-9._-]+==' "$1" | sed 's/ .*//; s/==/=/' | LC_ALL=C sort -t= -k1,1; }
LC_ALL=C join -t= -a1 -a2 -e '(none)' -o 0,1.2,2.2 <(pins requirements.lock) <(pins "$latest") | awk -F= '$2 != $3 {printf "  %-28s %s -> %s\n", $1, $2, $3; n++}
    END {if (!n) print "  nothing: the lock has the newest allowed releases"}'

"${pip[@]}" -r "$latest"
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -m asyncpaged --version

echo "== ruff, mypy and the tests on the newest releases"
"$VENV/bin/ruff" check src tests examples bench scripts
"$VENV/bin/ruff" format --check src tests examples bench scripts
"$VENV/bin/mypy"
"$VENV/bin/python" -m pytest "${pytest_args[@]}"

echo "== the newest releases pass"
if [[ $update == 1 ]]; then
  cp "$latest" requirements.lock
  echo "requirements.lock moved forward; commit it with the versions above, then rerun" \
       "bash scripts/setup.sh"
else
  echo "to move the lock forward: bash scripts/check_latest.sh --update (or cp $latest requirements.lock)"
fi
