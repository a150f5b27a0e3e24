"""The test suite's package.

The repository's top-level ``kernels/`` folder ships as ``asyncpaged.kernels``. With the
repository root on ``sys.path`` (pytest's rootdir insertion puts it there, and so does
``python -m`` for the working directory) the folder would also shadow an installed top-level
``kernels`` distribution: Hugging Face's, which transformers >= 5.25 requires and imports when
it loads. So the root moves behind the installed packages, where ``import tests...`` still
finds it (pytest's "append" import mode, ``pyproject.toml``, leaves it there), and the Python
subprocesses tests start (``python -m asyncpaged serve``, ``python -c`` probes) get
``PYTHONSAFEPATH``, so they do not put their working directory first either.
"""

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == _ROOT
    except OSError:
        return False


sys.path[:] = [entry for entry in sys.path if not _is_root(entry)] + [str(_ROOT)]
os.environ.setdefault("PYTHONSAFEPATH", "1")
