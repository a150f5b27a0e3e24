"""Load a transformers checkpoint directory into one of asyncpaged's model families.

A directory holds ``config.json`` (read with ``transformers.AutoConfig``), weights as
``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (``pytorch_model*.bin``
as a fallback, read with ``torch.load(weights_only=True)``), and tokenizer files. Every failure is a
typed ``ModelLoadError`` (a ``ValueError``) naming the file or tensor at fault.

Tensor parallel: a model built for one shard (``TensorShard``) declares which parameters are split
(``CausalLM.shard_rules``); the loader reads only this rank's slice of those from safetensors
(``safe_open(...).get_slice``: the rest of the tensor is never read), and skips the row-parallel
biases that only rank 0 holds. ``.bin`` files are read whole and then sliced.

dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the checkpoint's dtype, except
that half precision becomes float32 on CPU, where half-precision GEMMs are slow or inexact).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncpaged._log import get_logger
from asyncpaged.model.base import SINGLE_SHARD, CausalLM, ShardRule, TensorShard
from asyncpaged.model.compressed_tensors_scheme import (
    CompressedTensorsPlan,
    WeightScheme,
    build_weight,
    dequantize_weight,
    parse_quantization_config,
)
from asyncpaged.model.errors import CheckpointError, UnsupportedModelError
from asyncpaged.model.gemma import Gemma3ForConditionalGenerationText, GemmaForCausalLM
from asyncpaged.model.gguf_checkpoint import (
    TOKEN_EMBEDDING,
    GGUFCheckpoint,
    is_gguf_path,
    load_gguf_tokenizer,
    open_gguf_checkpoint,
)
from asyncpaged.model.gguf_checkpoint import dequantize as dequantize_gguf
from asyncpaged.model.gguf_weight import GGUFWeight
from asyncpaged.model.gpt2 import GPT2LMHeadModel
from asyncpaged.model.llama import LlamaForCausalLM
from asyncpaged.model.opt import OPTForCausalLM
from asyncpaged.model.phi3 import Phi3ForCausalLM
from asyncpaged.model.quantized_linear import attach_quantized

#: transformers architecture name -> family class
MODEL_REGISTRY: dict[str, Callable[[Any, TensorShard], CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGenerationText,  # text only
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: The transformers releases whose config objects the families are tested against (5.x: RoPE in
#: ``rope_parameters``, per-layer-type parameters, ``layer_types``). 4.x configs are read by the
#: legacy-field paths too, but are not tested; 4.46 silently dropped fields the families need.
MIN_TRANSFORMERS = (5, 0)
# vLLM's names of an fp8 KV cache's calibrated scales ("model.layers.0.self_attn.k_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")

_log = get_logger(__name__)


def check_transformers_version(version: str | None = None) -> None:
    """UnsupportedModelError unless transformers is at least ``MIN_TRANSFORMERS``."""
    if version is None:
        import transformers

        version = str(transformers.__version__)
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_TRANSFORMERS:
        raise UnsupportedModelError(
            f"asyncpaged needs transformers>={'.'.join(map(str, MIN_TRANSFORMERS))} (tested with "
            f"5.24), found {version}: older releases read the RoPE fields of these configs "
            "differently, and greedy output would be wrong. pip install -U 'transformers>=5'."
        )


def load_config(path: str | Path) -> Any:
    """Read ``config.json`` through transformers (a GGUF file: the config transformers builds
    from its metadata); CheckpointError when it is missing."""
    if is_gguf_path(path):
        check_transformers_version()
        return open_gguf_checkpoint(path).config
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {str(directory)!r}.")
    check_transformers_version()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(
            f"transformers cannot read the config in {str(directory)!r}: {exc}"
        ) from exc


def text_config(config: Any) -> Any:
    """The language model's config: ``config`` itself, or a multimodal one's ``text_config``."""
    get = getattr(config, "get_text_config", None)
    return config if get is None else get()


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """Map a dtype request ("auto" included) to a torch dtype for ``device``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise UnsupportedModelError(f"dtype {dtype} is not supported.")
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise UnsupportedModelError(f"dtype must be one of {[*_DTYPES, 'auto']}, got {dtype!r}.")
    stored = stored_dtype(config)
    if stored is None or (device.type == "cpu" and stored in (torch.float16, torch.bfloat16)):
        return torch.float32
    return stored


def stored_dtype(config: Any) -> torch.dtype | None:
    """The dtype the checkpoint's config names (``dtype`` or ``torch_dtype``), if one we load."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored.removeprefix("torch."), torch.float32)
    return stored if isinstance(stored, torch.dtype) and stored in _DTYPES.values() else None


def _weight_files(directory: Path) -> list[Path]:
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = directory / index_name
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"malformed weight index {str(index)!r}: {exc}") from exc
            files = [directory / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(
                    f"weight shards listed in {index_name} are missing from "
                    f"{str(directory)!r}: {missing}."
                )
            return files
        if (directory / single).is_file():
            return [directory / single]
    raise CheckpointError(
        f"no weights in {str(directory)!r}: expected model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json."
    )


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One stored tensor, read lazily: ``read(index)`` returns ``tensor[index]`` (the whole tensor
    for None) and, from safetensors, reads only those bytes."""

    name: str
    shape: torch.Size
    read: Callable[[tuple[slice, ...] | None], torch.Tensor]


def iter_checkpoint_entries(directory: str | Path) -> Iterator[CheckpointEntry]:
    """Yield a lazy entry for every tensor in the directory's weight files (CPU tensors).

    An entry is only readable until the next one is yielded (its file may be closed then)."""
    for file in _weight_files(Path(directory)):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        part = f.get_slice(name)
                        read = functools.partial(_read_safetensors, f, name, part)
                        yield CheckpointEntry(name, torch.Size(part.get_shape()), read)
            except Exception as exc:  # safetensors raises its own error types
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"cannot read {str(file)!r}: {exc}") from exc
        else:
            try:
                state = torch.load(str(file), map_location="cpu", weights_only=True)
            except Exception as exc:  # pickle and zip errors vary by torch version
                raise CheckpointError(f"cannot read {str(file)!r}: {exc}") from exc
            for name, whole in state.items():
                yield CheckpointEntry(name, whole.shape, functools.partial(_index, whole))


def _read_safetensors(
    file: Any, name: str, part: Any, index: tuple[slice, ...] | None
) -> torch.Tensor:
    tensor: torch.Tensor = file.get_tensor(name) if index is None else part[index]
    return tensor


def _index(tensor: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    return tensor if index is None else tensor[index]


def _read_shard(entry: CheckpointEntry, rule: ShardRule, dim: int, shard: TensorShard
                ) -> torch.Tensor:  # fmt: skip
    """This rank's slice of ``entry`` along stored dimension ``dim`` (of each fused part)."""
    unit = entry.shape[dim] // sum(rule.parts)
    pieces = []
    begin = 0  # where the part starts
    for size, ways, replicas in rule.slices(shard.world_size):
        width = size * unit // ways
        start = begin + shard.rank // replicas * width
        begin += size * unit
        index = tuple(
            slice(start, start + width) if d == dim else slice(None)
            for d in range(len(entry.shape))
        )
        pieces.append(entry.read(index))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _canonical_name(name: str, model: CausalLM, expected: dict[str, torch.Size]) -> str:
    name = model.parameter_name(name)
    if name not in expected and model.base_model_prefix + name in expected:
        return model.base_model_prefix + name  # saved from the base model, without its prefix
    return name


def load_weights(
    model: CausalLM,
    directory: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    plan: CompressedTensorsPlan | None = None,
) -> None:
    """Fill ``model`` (built uninitialised) from the checkpoint, strictly by name and shape.

    A tensor-parallel shard reads only its slice of each split parameter. With ``plan`` (a
    compressed-tensors checkpoint) every ``nn.Linear`` a config group targets reads its stored
    tensors (``scheme.tensor_names()``, nothing else) and keeps its weight quantized
    (``quantized_linear``, on ``device``: the CPU or CUDA); a quantized LM head is dequantized
    to ``dtype``."""
    expected = {name: p.shape for name, p in model.named_parameters()}
    quantized = {} if plan is None else _quantized_linears(model, plan)
    for module in quantized:
        del expected[f"{module}.weight"]
    pending: dict[str, dict[str, torch.Tensor]] = {module: {} for module in quantized}
    known = expected | {f"{module}.weight": torch.Size() for module in quantized}
    rules = model.shard_rules()
    dropped = model.dropped_checkpoint_keys()
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    kv_scales: list[str] = []  # an fp8 KV cache's calibrated scales (vLLM's names): unused
    for entry in iter_checkpoint_entries(directory):
        raw_name = entry.name
        prefix, _, suffix = raw_name.rpartition(".")
        module = _canonical_name(f"{prefix}.weight", model, known)[: -len(".weight")]
        if module in quantized and suffix in quantized[module][1].tensor_names():
            pending[module][suffix] = entry.read(None)
            continue
        name = _canonical_name(raw_name, model, expected)
        if name not in expected:
            if raw_name.endswith(KV_SCALE_SUFFIXES):
                kv_scales.append(raw_name)
            elif not (model.is_ignored_checkpoint_key(name) or name in dropped):
                unexpected.append(raw_name)
            continue
        transposed = model.is_transposed_checkpoint_key(name)
        rule = rules.get(name)
        want = list(expected[name])  # the full (unsharded) shape, in the model's layout
        if rule is not None:
            want[rule.dim] = rule.full_width(want[rule.dim], model.shard.world_size)
        if transposed:
            want.reverse()
        if entry.shape != torch.Size(want):
            raise CheckpointError(
                f"tensor {raw_name!r} has shape {tuple(entry.shape)} in the checkpoint, but the "
                f"config implies {tuple(want)}."
            )
        if rule is None:
            tensor = entry.read(None)
        else:
            stored_dim = len(want) - 1 - rule.dim if transposed else rule.dim
            tensor = _read_shard(entry, rule, stored_dim, model.shard)
        stored = tensor.t() if transposed else tensor
        loaded[name] = stored.to(device=device, dtype=dtype).contiguous()
    head = model.lm_head_weight()
    for module, (layer, scheme) in quantized.items():
        names = scheme.tensor_names()
        absent = [f"{module}.{n}" for n in names if n not in pending[module]]
        if absent:
            raise CheckpointError(
                f"checkpoint {str(directory)!r} lacks {absent} of layer {module!r}, which "
                f"config group {scheme.group!r} quantizes ({scheme.format})."
            )
        weight = build_weight(scheme, pending.pop(module), module, layer.out_features,
                              layer.in_features)  # fmt: skip
        if layer.weight is head:  # the LM head is read elsewhere: kept in float
            loaded[f"{module}.weight"] = dequantize_weight(weight).to(device=device, dtype=dtype)
        else:
            attach_quantized(layer, weight.to(device))
            loaded[f"{module}.weight"] = layer.weight
        expected[f"{module}.weight"] = loaded[f"{module}.weight"].shape
    missing = sorted(set(expected) - set(loaded))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} does not match its config: missing tensors "
            f"{missing[:10]}{' ...' if len(missing) > 10 else ''}, unexpected tensors "
            f"{sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}."
        )
    if kv_scales:
        _log.info("checkpoint_kv_scales_unused", num_tensors=len(kv_scales), first=kv_scales[0],
                  reason="an int8 / fp8 KV cache scales each token and KV head by its own "
                         "amax (kv_quant); per-layer k_scale / v_scale are not used")  # fmt: skip
    model.load_state_dict(loaded, strict=True, assign=True)


def _quantized_linears(
    model: CausalLM, plan: CompressedTensorsPlan
) -> dict[str, tuple[torch.nn.Linear, WeightScheme]]:
    """module name -> (layer, scheme) for every ``nn.Linear`` the plan quantizes."""
    if model.shard.world_size != 1:
        raise UnsupportedModelError(
            "a compressed-tensors model runs on one rank (no tensor parallelism) for now."
        )
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            scheme = plan.scheme_for(name, module)
            if scheme is not None:
                if model.is_transposed_checkpoint_key(f"{name}.weight"):
                    raise UnsupportedModelError(
                        f"layer {name!r} is stored transposed (Conv1D): compressed-tensors "
                        "weights for it are not supported."
                    )
                found[name] = (module, scheme)
    return found


def compressed_tensors_plan(directory: str | Path) -> CompressedTensorsPlan | None:
    """The parsed ``quantization_config`` of the directory's config.json (None without one);
    UnsupportedModelError for a quantization method or scheme asyncpaged does not run."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from exc
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(path)!r}: quantization_config must be an object.")
    return parse_quantization_config(raw, str(path))


def load_gguf_weights(
    model: CausalLM, checkpoint: GGUFCheckpoint, dtype: torch.dtype, device: torch.device
) -> None:
    """Fill ``model`` from a GGUF file, strictly by name and shape: the weight of every
    ``nn.Linear`` stored in a quantized type stays quantized (``quantized_linear``), and so do a
    quantized token embedding and LM head (``CausalLM.quantized_embedding`` and
    ``quantized_head``: one table when tied); everything else (norms, float tensors) is
    dequantized to ``dtype``. One shard only, on the CPU or CUDA."""
    if model.shard.world_size != 1:
        raise UnsupportedModelError(
            "a GGUF model runs on one rank (no tensor parallelism) for now."
        )
    _check_quantized_device(device, "a GGUF model")
    params = dict(model.named_parameters())
    expected = {name: p.shape for name, p in params.items()}
    linears = {f"{name}.weight": m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}  # fmt: skip
    head = model.lm_head_weight()
    emptied: set[str] = set()
    tensors = checkpoint.tensors
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(model.dropped_checkpoint_keys()))
    if missing or unexpected:
        raise CheckpointError(
            f"GGUF file {str(checkpoint.path)!r} does not match its config: missing tensors "
            f"{missing[:10]}, unexpected tensors {unexpected[:10]}."
        )
    loaded: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tensor.shape} in {str(checkpoint.path)!r}, but the "
                f"config implies {tuple(shape)}."
            )
        layer = linears.get(name)
        is_head = params[name] is head
        keeps = layer is not None or is_head or name == TOKEN_EMBEDDING
        if tensor.qtype.block_size > 1 and keeps:
            weight = GGUFWeight.from_rows(
                tensor.rows(), tensor.qtype.name, int(shape[1]), tensor.row_permutation
            ).to(device)
            if is_head:
                model.quantized_head = weight
            if name == TOKEN_EMBEDDING:
                model.quantized_embedding = weight
            if layer is not None and not is_head:
                attach_quantized(layer, weight)
            else:
                emptied.add(name)
            continue
        loaded[name] = dequantize_gguf(tensor).to(device=device, dtype=dtype).contiguous()
    for name in emptied:  # kept quantized: the parameter only carries the dtype
        owner, _, attr = name.rpartition(".")
        empty = torch.empty(0, dtype=dtype, device=device)
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(empty, requires_grad=False))
    model.load_state_dict(loaded, strict=False, assign=True)


def _check_quantized_device(device: torch.device, what: str) -> None:
    """Quantized weights multiply through the native CPU kernels or the Triton (CUDA) ones."""
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedModelError(f"{what} runs on the CPU or CUDA, not on {device.type!r}.")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    shard: TensorShard = SINGLE_SHARD,
) -> CausalLM:
    """Build the family for ``path``'s architecture and load its weights (only ``shard``'s part
    of the split ones); eval mode, no grad."""
    directory = Path(path)
    gguf = open_gguf_checkpoint(directory) if is_gguf_path(directory) else None
    config = load_config(directory) if gguf is None else gguf.config
    architectures = list(getattr(config, "architectures", None) or [])
    family = next((MODEL_REGISTRY[a] for a in architectures if a in MODEL_REGISTRY), None)
    if family is None:
        raise UnsupportedModelError(
            f"architecture {architectures or config.model_type!r} in {str(directory)!r} is not "
            f"supported; supported: {sorted(MODEL_REGISTRY)}."
        )
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)
    model = family(config, shard)  # uninitialised parameters (base.Linear / base.Embedding)
    if gguf is None:
        plan = compressed_tensors_plan(directory)
        if plan is not None:
            _check_quantized_device(torch_device, "a compressed-tensors model")
        load_weights(model, directory, torch_dtype, torch_device, plan)
    else:
        load_gguf_weights(model, gguf, torch_dtype, torch_device)
    model.eval().requires_grad_(False)
    return model


def linear_shapes(path: str | Path) -> tuple[tuple[int, int, bool], ...]:
    """The distinct ``(in_features, out_features, has_bias)`` of the model's ``nn.Linear`` layers
    and its LM head (``(hidden, vocab, False)``, last), from a skeleton built on the meta device:
    no weight is read. What the CPU plan checks packing on (``lever_checks``)."""
    config = load_config(Path(path))
    architectures = list(getattr(config, "architectures", None) or [])
    family = next((MODEL_REGISTRY[a] for a in architectures if a in MODEL_REGISTRY), None)
    if family is None:
        return ()
    with torch.device("meta"):
        model = family(config, SINGLE_SHARD)
    head = model.lm_head_weight()
    shapes = {(m.in_features, m.out_features, m.bias is not None) for m in model.modules()
              if isinstance(m, torch.nn.Linear) and m.weight is not head}  # fmt: skip
    return (*sorted(shapes), (int(head.shape[1]), int(head.shape[0]), False))


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer through ``transformers.AutoTokenizer`` (a GGUF file: the one
    transformers builds from its metadata)."""
    if is_gguf_path(path):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
