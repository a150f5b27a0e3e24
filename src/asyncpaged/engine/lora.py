"""The engine's LoRA adapters: each request's adapter checked before it is queued, and
snapshotted under its content digest.

A :class:`LoRARequest` names a PEFT directory; :meth:`LoRACatalog.resolve` checks it against the
base model (``model/lora_adapter.py``: it exists and parses, its rank is within
``max_lora_rank``, each target is a linear of the model with the same shape) and returns the
digest of its bytes and a private copy of those bytes, which is what the runner loads. The
digest keys the request's prefix-cache blocks and its slot, so a directory rewritten under the
same name is a new adapter, and one adapter under two names is one. A check is kept per
directory until the files' size or modification time change.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from asyncpaged.errors import InvalidRequestError
from asyncpaged.lora_request import LoRARequest
from asyncpaged.model.errors import CheckpointError
from asyncpaged.model.loader import iter_checkpoint_entries, load_config, text_config
from asyncpaged.model.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapterError,
    check_adapter,
    write_snapshot,
)

# GPT-2 stores its projections as Conv1D weights, [in, out]
_TRANSPOSED_FAMILIES = {"gpt2": ("c_attn", "c_proj", "c_fc")}


def base_linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """The base checkpoint's 2-D weights as ``module -> (out, in)`` (the name without
    ``.weight``, as PEFT's keys name modules), from the files' headers."""
    model_type = getattr(text_config(load_config(model_dir)), "model_type", "")
    transposed = _TRANSPOSED_FAMILIES.get(model_type, ())
    shapes: dict[str, tuple[int, int]] = {}
    for entry in iter_checkpoint_entries(model_dir):
        if not entry.name.endswith(".weight") or len(entry.shape) != 2:
            continue
        module = entry.name.removesuffix(".weight")
        out_f, in_f = int(entry.shape[0]), int(entry.shape[1])
        if module.rsplit(".", 1)[-1] in transposed:
            out_f, in_f = in_f, out_f
        shapes[module] = (out_f, in_f)
        if module.startswith("transformer."):  # GPT-2's keys, with and without the prefix
            shapes[module.removeprefix("transformer.")] = (out_f, in_f)
    return shapes


class LoRACatalog:
    """The adapters the engine has checked, by directory, and their snapshots."""

    def __init__(self, model_dir: str, max_lora_rank: int) -> None:
        self._model_dir = model_dir
        self._max_lora_rank = max_lora_rank
        self._shapes: dict[str, tuple[int, int]] | None = None  # read at the first adapter
        self._checked: dict[str, tuple[tuple[int, ...], str, str]] = {}
        self._snapshots = tempfile.TemporaryDirectory(prefix="asyncpaged-lora-")

    def resolve(self, lora: LoRARequest) -> tuple[str, str]:
        """The adapter's content digest and the path of its snapshot; raises
        :class:`InvalidRequestError` when it cannot serve on this model."""
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(lora).__name__}."
            )
        path = os.path.realpath(lora.lora_path)
        stamp = _stamp(path)
        known = self._checked.get(path)
        if known is not None and known[0] == stamp:
            return known[1], known[2]
        if self._shapes is None:
            try:
                self._shapes = base_linear_shapes(self._model_dir)
            except CheckpointError as exc:  # (a GGUF file: no safetensors or .bin weights)
                raise InvalidRequestError(
                    f"lora_request: the base checkpoint's weights cannot be listed: {exc}"
                ) from exc
        try:
            info = check_adapter(path, max_lora_rank=self._max_lora_rank, base_shapes=self._shapes)
        except (LoRAAdapterError, OSError) as exc:
            raise InvalidRequestError(f"lora_request {lora.lora_name!r}: {exc}") from exc
        snapshot = write_snapshot(info, Path(self._snapshots.name))
        self._checked[path] = (stamp, info.digest, snapshot)
        return info.digest, snapshot

    def close(self) -> None:
        """Delete the snapshots (the engine is closed: no runner reads them any more)."""
        self._snapshots.cleanup()


def _stamp(path: str) -> tuple[int, ...]:
    """Size, modification time and inode of the adapter's files (zeros where missing: the
    check then names what is missing)."""
    stamp: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            stamp += [0, 0, 0]
            continue
        stamp += [st.st_size, st.st_mtime_ns, st.st_ino]
    return tuple(stamp)
