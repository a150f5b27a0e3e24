#!/usr/bin/env bash
# Create .venv and install asyncpaged with its dev extra. Idempotent and offline-friendly:
# torch is pinned to the CPU wheel first so that no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
.venv/bin/python -c "import asyncpaged, torch; print('asyncpaged', asyncpaged.__version__, 'torch', torch.__version__)"
