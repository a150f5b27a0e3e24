"""A model's generation defaults: its end-of-turn ids and sampling defaults.

transformers' ``generate`` reads ``generation_config.json``: an ``eos_token_id`` that is an int or
a list (Llama 3 and most chat models list the end-of-turn ids there, e.g. ``<|eot_id|>`` next to
``<|end_of_text|>``), and the sampling settings the model was tuned for (Qwen3: temperature 0.6,
top_k 20, top_p 0.95). The engine ends a sequence at any of the EOS ids, and, like vLLM's
``generation_config="auto"``, uses the sampling settings where a request leaves them unset.

Modes (``EngineConfig.generation_config``): ``"auto"`` reads the checkpoint's file, ``"none"``
ignores it (EOS is then the tokenizer's, else ``config.json``'s), and a directory path reads the
file in that directory instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncpaged._log import get_logger
from asyncpaged.errors import InvalidRequestError
from asyncpaged.model.errors import CheckpointError
from asyncpaged.sampling_params import SamplingParams

log = get_logger(__name__)

#: generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a model asks of generation: ``eos_token_ids`` end a sequence (unless
    ``ignore_eos``); ``sampling`` fills the SamplingParams fields a caller left unset."""

    eos_token_ids: frozenset[int]
    sampling: Mapping[str, Any] = field(default_factory=dict)

    def sampling_params(self) -> SamplingParams:
        """The model's default SamplingParams (vLLM's ``get_default_sampling_params``)."""
        return SamplingParams().with_defaults(self.sampling)


def _ids(value: object) -> frozenset[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return frozenset(value)
    return frozenset()


def _read(directory: Path) -> dict[str, Any]:
    file = directory / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"malformed {str(file)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r} is not a JSON object.")
    return data


def _sampling(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The file's sampling settings that SamplingParams accepts; each rejected one is logged."""
    out: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as exc:
            log.warning("generation_default_ignored", source=source, field=key, error=str(exc))
            continue
        out[name] = value
    return out


def load_generation_defaults(
    checkpoint: Path, mode: str, *, tokenizer_eos: int | None, config_eos: object
) -> GenerationDefaults:
    """The defaults for ``checkpoint`` under ``mode`` ("auto", "none" or a directory)."""
    fallback = _ids(config_eos) if tokenizer_eos is None else frozenset({tokenizer_eos})
    if mode == "none":
        return GenerationDefaults(fallback)
    directory = checkpoint if mode == "auto" else Path(mode).expanduser()
    if mode != "auto" and not directory.is_dir():
        raise CheckpointError(f"generation_config={mode!r} is not 'auto', 'none' or a directory.")
    data = _read(directory)
    eos = _ids(data.get("eos_token_id")) or _ids(config_eos)
    if tokenizer_eos is not None:
        eos |= {tokenizer_eos}
    sampling = _sampling(data, str(directory / "generation_config.json"))
    if sampling:
        log.info("generation_defaults_loaded", source=str(directory), **sampling)
    return GenerationDefaults(eos, sampling)
