"""compressed-tensors checkpoints: the ``quantization_config`` of ``config.json`` read with the
``compressed_tensors`` package's own models (``QuantizationConfig``, ``QuantizationScheme``,
``QuantizationArgs``), checked against what asyncpaged runs, and a quantized linear layer's
stored tensors turned into a :class:`~asyncpaged.model.quantized_linear.QuantizedWeight`.

What runs (everything else is refused with an ``UnsupportedModelError`` naming the field)::

    format            weights                        strategy                  stored per layer
    pack-quantized    int, 4 or 8 bits, sym / asym   group (2^n >= 32), channel  weight_packed,
                                                      (tensor: symmetric)          weight_scale,
                                                                                   weight_shape,
                                                                                   [weight_zero_point]
    float-quantized   float, 8 bits (e4m3), sym      tensor, channel, block     weight, weight_scale

Input activations: none, or dynamic 8-bit float (FP8_DYNAMIC, FP8_BLOCK): those run in float32
here (no activation quantization), as transformers' decompressed model runs them. Static or int
activation quantization, output activations, a KV cache scheme, sparsity, transforms, grouped
activation ordering (``g_idx``) and ``quantization_status`` other than ``compressed`` are
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncpaged.kernels.scaled_matmul import RUN, ScaledLayout, dequantize_codes
from asyncpaged.model.errors import CheckpointError, UnsupportedModelError
from asyncpaged.model.fp8_weight import FP8Weight
from asyncpaged.model.packed_int_weight import PackedIntWeight, unpack_int32
from asyncpaged.model.quantized_linear import QuantizedWeight

__all__ = [
    "CompressedTensorsPlan",
    "WeightScheme",
    "build_weight",
    "dequantize_weight",
    "parse_quantization_config",
]

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "float-quantized")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightScheme:
    """How the layers one config group targets store their weights."""

    group: str  # the key in config_groups
    format: str
    num_bits: int
    is_float: bool
    strategy: str  # "group", "channel", "tensor" or "block"
    group_size: int | None
    block_structure: tuple[int, int] | None
    symmetric: bool
    targets: tuple[str, ...]

    @property
    def code(self) -> str:
        return "fp8_e4m3" if self.is_float else f"int{self.num_bits}"

    def tensor_names(self) -> tuple[str, ...]:
        """The suffixes (after ``<module>.``) a layer of this scheme stores."""
        if self.format == "float-quantized":
            return ("weight", "weight_scale")
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names if self.symmetric else (*names, "weight_zero_point")


@dataclass(frozen=True, slots=True)
class CompressedTensorsPlan:
    """The checkpoint's config groups and ``ignore`` list."""

    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, name: str, module: nn.Module) -> WeightScheme | None:
        """The scheme of the first config group that targets module ``name`` (by name, regex or
        class, as compressed-tensors matches), unless ``ignore`` names it."""
        from compressed_tensors.utils.match import is_match

        for scheme in self.schemes:
            if is_match(name, module, list(scheme.targets), list(self.ignore)):
                return scheme
        return None


def parse_quantization_config(raw: Mapping[str, Any], where: str) -> CompressedTensorsPlan:
    """``raw``: config.json's ``quantization_config`` (``where`` names the file in errors)."""
    field = "quantization_config"
    method = raw.get("quant_method")
    if method != QUANT_METHOD:
        raise UnsupportedModelError(
            f"{where}: {field}.quant_method {method!r} is not supported; asyncpaged loads "
            f"{QUANT_METHOD!r} checkpoints (and GGUF files)."
        )
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme", "moe_sparsity_config"):
        if raw.get(key):
            raise UnsupportedModelError(f"{where}: {field}.{key} is not supported.")
    for name, group in (raw.get("config_groups") or {}).items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping) and weights.get("actorder") in ("group", True):
            raise UnsupportedModelError(
                f"{where}: {field}.config_groups.{name}.weights.actorder "
                f"{weights.get('actorder')!r} (weights permuted by g_idx) is not supported."
            )
    try:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
        from pydantic import ValidationError
    except ImportError as exc:
        raise UnsupportedModelError(
            f"{where} is a compressed-tensors checkpoint, which needs the compressed-tensors "
            "package: pip install 'asyncpaged[quantized]'."
        ) from exc

    try:
        config = QuantizationConfig.model_validate(dict(raw))
    except (ValidationError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: malformed {field}: {exc}") from exc
    status = str(getattr(config.quantization_status, "value", config.quantization_status))
    if status != "compressed":
        raise UnsupportedModelError(
            f"{where}: {field}.quantization_status {status!r} is not supported (only "
            "'compressed' checkpoints)."
        )
    schemes = []
    for name, group in config.config_groups.items():
        scheme = preset_name_to_scheme(name, group) if isinstance(group, list) else group
        schemes.append(_weight_scheme(name, scheme, config.format, f"{where}: {field}"))
    return CompressedTensorsPlan(tuple(schemes), tuple(config.ignore or ()))


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def _weight_scheme(name: str, scheme: Any, default_format: str, where: str) -> WeightScheme:
    at = f"{where}.config_groups.{name}"
    fmt = str(_value(scheme.format) or default_format)
    if fmt not in FORMATS:
        raise UnsupportedModelError(f"{at}.format {fmt!r} is not supported; supported: {FORMATS}.")
    if scheme.output_activations is not None:
        raise UnsupportedModelError(f"{at}.output_activations is not supported.")
    act = scheme.input_activations
    if act is not None and not (
        _value(act.type) == "float" and act.num_bits == 8 and _value(act.dynamic) in (True, "local")
    ):
        raise UnsupportedModelError(
            f"{at}.input_activations ({_value(act.type)} {act.num_bits}-bit, dynamic="
            f"{_value(act.dynamic)}) is not supported: only dynamic 8-bit float activations, "
            "which run in float32 here."
        )
    w = scheme.weights
    if w is None:
        raise UnsupportedModelError(f"{at}.weights is missing: nothing to load quantized.")
    kind, strategy = str(_value(w.type)), str(_value(w.strategy))
    if _value(w.dynamic) not in (False, None):
        raise UnsupportedModelError(f"{at}.weights.dynamic {_value(w.dynamic)!r} is not supported.")
    is_float = fmt == "float-quantized"
    if kind != ("float" if is_float else "int"):
        raise UnsupportedModelError(f"{at}.weights.type {kind!r} does not fit format {fmt!r}.")
    if w.num_bits not in ((8,) if is_float else (4, 8)):
        raise UnsupportedModelError(
            f"{at}.weights.num_bits {w.num_bits} is not supported for {fmt} (int 4 or 8, float 8)."
        )
    allowed = ("tensor", "channel", "block") if is_float else ("group", "channel", "tensor")
    if strategy not in allowed:
        raise UnsupportedModelError(
            f"{at}.weights.strategy {strategy!r} is not supported for {fmt}; supported: {allowed}."
        )
    if not w.symmetric and (is_float or strategy == "tensor"):
        raise UnsupportedModelError(
            f"{at}.weights.symmetric false is not supported for {strategy} {kind} weights."
        )
    group_size = w.group_size if strategy == "group" else None
    block = tuple(w.block_structure) if strategy == "block" and w.block_structure else None
    width = group_size if group_size is not None else (block[1] if block else None)
    if width is not None and (width < RUN or width & (width - 1)):
        what = "group_size" if group_size is not None else "block_structure"
        raise UnsupportedModelError(
            f"{at}.weights.{what} {width} is not supported: a power of two >= {RUN}."
        )
    if strategy == "block" and (block is None or len(block) != 2 or block[0] < 1):
        raise CheckpointError(f"{at}.weights.block_structure must be [rows, columns], got {block}.")
    return WeightScheme(
        group=name,
        format=fmt,
        num_bits=w.num_bits,
        is_float=is_float,
        strategy=strategy,
        group_size=group_size,
        block_structure=None if block is None else (block[0], block[1]),
        symmetric=bool(w.symmetric),
        targets=tuple(scheme.targets),
    )


def build_weight(
    scheme: WeightScheme,
    tensors: Mapping[str, torch.Tensor],
    module: str,
    out_features: int,
    in_features: int,
) -> QuantizedWeight:
    """The quantized weight of layer ``module`` [out, in] from its stored tensors (suffix ->
    tensor, exactly ``scheme.tensor_names()``); CheckpointError on a wrong dtype or shape."""
    n, k = out_features, in_features
    if k % RUN != 0:
        raise UnsupportedModelError(
            f"{module}: in_features {k} is not a multiple of {RUN}, which the kernels need."
        )
    scale = _tensor(tensors, module, "weight_scale", _SCALE_DTYPES)
    group, row_block = _grouping(scheme, n, k)
    want = (-(-n // row_block), -(-k // group))
    if scheme.strategy == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1, 1)
    _check_shape(scale, want, module, "weight_scale")
    zeros = None
    if scheme.format == "pack-quantized" and not scheme.symmetric:
        zp = _tensor(tensors, module, "weight_zero_point", (torch.int32,))
        _check_shape(zp, (-(-n * scheme.num_bits // 32), want[1]), module, "weight_zero_point")
        zeros = unpack_int32(zp.T.contiguous(), scheme.num_bits, n).T.float().contiguous()
    layout = ScaledLayout(
        code=scheme.code,
        in_features=k,
        scales=scale.float().contiguous(),
        zeros=zeros,
        group_size=group,
        row_block=row_block,
        scale_dtype=scale.dtype,
    )
    if scheme.format == "float-quantized":
        weight = _tensor(tensors, module, "weight", (torch.float8_e4m3fn,))
        _check_shape(weight, (n, k), module, "weight")
        return FP8Weight.from_fp8(weight, layout)
    packed = _tensor(tensors, module, "weight_packed", (torch.int32,))
    _check_shape(packed, (n, -(-k * scheme.num_bits // 32)), module, "weight_packed")
    shape = _tensor(tensors, module, "weight_shape", (torch.int64, torch.int32))
    if shape.tolist() != [n, k]:
        raise CheckpointError(
            f"{module}.weight_shape is {shape.tolist()}, but the config implies {[n, k]}."
        )
    return PackedIntWeight.from_packed(packed, scheme.num_bits, layout)


def dequantize_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix of a weight ``build_weight`` made (for layers kept in float, such as
    a quantized LM head)."""
    assert isinstance(weight, (PackedIntWeight, FP8Weight)), type(weight)
    return dequantize_codes(weight.codes, weight.layout)


def _grouping(scheme: WeightScheme, n: int, k: int) -> tuple[int, int]:
    """(group_size, row_block) of the scales."""
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        if k % scheme.group_size != 0:
            raise CheckpointError(
                f"group_size {scheme.group_size} does not divide in_features {k}."
            )
        return scheme.group_size, 1
    if scheme.strategy == "block":
        assert scheme.block_structure is not None
        return scheme.block_structure[1], scheme.block_structure[0]
    return k, (1 if scheme.strategy == "channel" else n)


def _tensor(
    tensors: Mapping[str, torch.Tensor], module: str, suffix: str, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    t = tensors[suffix]
    if t.dtype not in dtypes:
        raise CheckpointError(
            f"tensor {module}.{suffix} has dtype {t.dtype}; expected one of {list(dtypes)}."
        )
    return t


def _check_shape(t: torch.Tensor, want: tuple[int, ...], module: str, suffix: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise CheckpointError(
            f"tensor {module}.{suffix} has shape {tuple(t.shape)} in the checkpoint, but the "
            f"config implies {tuple(want)}."
        )
