#!/usr/bin/env bash
# Create .venv and install asyncpaged with its dev extra at the exact versions of
# requirements.lock (torch: the CPU wheel), so every fresh machine gets the same environment.
# Idempotent: a rerun moves an existing .venv back to the lock. scripts/lock.sh writes the lock;
# scripts/check_latest.sh tries the newest releases before the lock moves forward.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" -r requirements.lock
"${pip[@]}" --no-deps -e .
.venv/bin/python -m asyncpaged --version
