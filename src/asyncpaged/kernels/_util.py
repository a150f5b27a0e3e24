"""Small helpers shared by the kernel modules (no Triton code here)."""

from __future__ import annotations

import functools

import torch

# Under the interpreter the grid runs serially on the CPU: a fixed, small target keeps split-K
# reachable in tests with the same heuristic the GPU uses.
_INTERPRETER_TARGET_PROGRAMS = 16


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated while ``TRITON_INTERPRET=1`` (decided at import time)."""
    return type(kernel).__name__ == "InterpretedFunction"


@functools.cache
def _cuda_target(index: int) -> int:
    return 2 * int(torch.cuda.get_device_properties(index).multi_processor_count)


def target_num_programs(device: torch.device) -> int:
    """About two programs per SM on CUDA; a fixed number elsewhere (interpreter)."""
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else 0)
    return _INTERPRETER_TARGET_PROGRAMS


@functools.cache
def _cuda_shared_mem(index: int) -> int:
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except (ImportError, AttributeError, KeyError, RuntimeError):
        return 0  # no active Triton driver, or another driver API: the conservative tiles


def max_shared_mem(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on CUDA; None (no limit) elsewhere, where the
    interpreter runs the kernels."""
    if device.type == "cuda":
        return _cuda_shared_mem(device.index if device.index is not None else 0)
    return None
