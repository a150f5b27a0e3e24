"""Which attention backend a runner uses: Triton on CUDA, the native C++ kernels on CPU, the
torch path where neither is available (or asked for)."""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from asyncpaged._log import get_logger
from asyncpaged.errors import InvalidRequestError
from asyncpaged.model.attention import AttentionBackend, TorchAttentionBackend

_log = get_logger(__name__)

AttentionChoice = Literal["auto", "torch", "triton", "cpu"]
TRITON_HINT = (
    "the Triton attention kernels need triton: pip install 'asyncpaged[cuda]' "
    "(attention_backend='torch' runs without it)."
)


def select_attention_backend(device: str, choice: AttentionChoice) -> AttentionBackend:
    """ "auto": Triton on CUDA; on CPU the native C++ decode kernel, or the torch path when it
    cannot be built here (no compiler). "cpu" demands the native kernel."""
    device_type = torch.device(device).type
    if choice == "torch" or (choice == "auto" and device_type not in ("cpu", "cuda")):
        return TorchAttentionBackend()
    if choice == "triton" or (choice == "auto" and device_type == "cuda"):
        if importlib.util.find_spec("triton") is None:  # not installed: the `cuda` extra
            if choice == "triton":
                raise InvalidRequestError(TRITON_HINT)
            _log.warning("triton_unavailable", hint=TRITON_HINT, fallback="torch")
            return TorchAttentionBackend()
        from asyncpaged.kernels.backend import make_attention_backend

        triton_backend: AttentionBackend = make_attention_backend(device, "triton")
        return triton_backend
    from asyncpaged.kernels.cpu_attention import CpuAttentionBackend

    native = CpuAttentionBackend()
    if native.is_native:
        cpu_backend: AttentionBackend = native
        return cpu_backend
    if choice == "cpu":
        raise InvalidRequestError(
            "attention_backend='cpu' needs the native CPU kernel, which could not be built here "
            "(see the cpu_kernel_unavailable log event); use 'auto' or 'torch'."
        )
    return TorchAttentionBackend()
