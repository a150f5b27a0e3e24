"""Where a model lives: a local checkpoint directory, or a Hugging Face hub id.

``resolve_model_path("path/to/dir")`` returns the directory. ``resolve_model_path("org/name",
revision=None)`` returns the snapshot directory of that repository in the Hugging Face cache, as
``huggingface_hub`` lays it out (``models--org--name/snapshots/<commit>``; ``revision`` is a
branch, a tag or a commit hash, default ``main``). The cache is ``HF_HUB_CACHE`` (else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), read when the function runs, so a host that
sets the variable after import is obeyed. A snapshot missing from the cache is downloaded
(config, tokenizer and safetensors files only), unless ``HF_HUB_OFFLINE`` is set: then it is a
``CheckpointError`` naming the id, the revision and the cache searched.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncpaged.model.errors import CheckpointError

#: Files fetched for a hub id that is not cached yet: what the loader and tokenizer read.
DOWNLOAD_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)

_TRUE = frozenset({"1", "on", "yes", "true"})


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses now (environment read at each call)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _looks_like_repo_id(model: str) -> bool:
    if model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1:
        return False
    return all(part and not part.startswith(".") for part in model.split("/"))


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """The checkpoint directory for ``model`` (a directory, a GGUF file, or a hub id in the HF
    cache).

    Raises ``CheckpointError`` when neither is found; nothing else is raised for a missing
    model. Downloads only what is missing and only when not offline."""
    local = Path(model).expanduser()
    if local.is_file() and local.suffix == ".gguf":  # a GGUF file (the first of a split set)
        if revision is not None:
            raise CheckpointError(f"revision={revision!r} selects a hub snapshot, but {model!r} "
                                  "is a local GGUF file; drop revision.")  # fmt: skip
        return local
    if local.is_dir():
        if revision is not None:
            raise CheckpointError(
                f"revision={revision!r} selects a hub snapshot, but {model!r} is a local "
                "directory; drop revision or pass a hub id."
            )
        return local
    if not _looks_like_repo_id(model):
        raise CheckpointError(f"no checkpoint directory {model!r} (and it is not a hub id).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    where = f"{model!r} (revision {revision or 'main'!r})"
    try:
        cached = snapshot_download(model, revision=revision, cache_dir=cache,
                                   local_files_only=True)  # fmt: skip
        return Path(str(cached))
    except LocalEntryNotFoundError:
        if is_offline():
            raise CheckpointError(
                f"{where} is not a local directory and is not in the Hugging Face cache at "
                f"{str(cache)!r}; HF_HUB_OFFLINE is set, so nothing is downloaded."
            ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read {where} from the cache at {str(cache)!r}: {exc}"
        ) from exc
    try:
        path = snapshot_download(
            model, revision=revision, cache_dir=cache, allow_patterns=list(DOWNLOAD_PATTERNS)
        )
    except Exception as exc:  # huggingface_hub raises many error types (HTTP, auth, repo)
        raise CheckpointError(f"cannot download {where}: {exc}") from exc
    return Path(str(path))
