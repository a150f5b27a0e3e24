"""A validated GGUF file, or split set: header, metadata and tensor table, checked before use.

``open_gguf(path)`` parses every byte of the header, the metadata and the tensor table with a
small strict reader (``struct`` over a read-only ``mmap``, bounded at every step) and checks the
tensor table against the file before any tensor byte is handed out. What it returns is a
``GGUFFile``: the metadata as Python values and one ``GGUFTensor`` per tensor, whose ``data`` is
a zero-copy, read-only ``uint8`` view of that tensor's bytes in the mapped file (the weights stay
as stored: quantized, never copied). It needs neither the ``gguf`` package nor transformers.

One file (little-endian, GGUF versions 2 and 3)::

    0 +-------------------------------------------------------------+
      | "GGUF" | u32 version | u64 tensor_count | u64 kv_count       |  header
      | kv_count x (string key, u32 value_type, value)              |  metadata
      | tensor_count x (string name, u32 n_dims, u64 ne[n_dims],    |  tensor table
      |                 u32 ggml_type, u64 offset)                   |
      | zero padding up to a multiple of general.alignment (32)     |
      +-------------------------------------------------------------+ data_start
      | tensor bytes: tensor i at data_start + offset_i             |  data section
      +-------------------------------------------------------------+ end of file
    string = u64 byte length + UTF-8 bytes; array = u32 element type + u64 count + elements

``ne[0]`` is the row length (the innermost dimension), so the torch shape is ``ne`` reversed. A
quantized row is ``ne[0] / block_size`` blocks of ``type_size`` bytes each.

What is checked (``GGUFError`` names the file, the tensor or key, and what is wrong):

- the magic and the version (2 or 3; version 1 and big-endian files are UnsupportedModelError);
- every count and length against the bytes left in the file (a truncated or inflated header never
  reads past the end or allocates more than the file could hold), keys and names valid UTF-8;
- metadata value types (known types only; bool bytes 0 or 1; no nested arrays); duplicate keys;
  the types of the well-known ``general.*``, ``split.*`` and ``tokenizer.*`` keys
  (``GENERAL_SCHEMA``; ``check_metadata_types`` checks further keys);
- per tensor: a name of at most 256 bytes, not seen before (in any part); ``n_dims`` in 1..4;
  every dimension > 0; a known type that asyncpaged supports (``GGMLType``; a known but
  unsupported one, like Q2_K, is an UnsupportedModelError naming it); a row length divisible by
  the type's block size; an offset aligned to ``general.alignment`` and
  ``offset + nbytes`` within the data section of its own file; no two tensors overlapping;
- a split set (``name-00001-of-00003.gguf``): every part exists, each says ``split.no`` (its
  0-based index) and the same ``split.count``; ``split.tensors.count`` equals the tensors found.
"""

from __future__ import annotations

import enum
import itertools
import math
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncpaged.model.errors import GGUFError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_TENSOR_NAME_BYTES = 256
MAX_KEY_BYTES = 65535
MAX_ALIGNMENT = 1 << 20

_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGMLType(enum.IntEnum):
    """The tensor types asyncpaged reads (values are ggml's ``ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30

    @property
    def block_size(self) -> int:
        """Elements per block (1 for the float types)."""
        return _BLOCKS[self][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return _BLOCKS[self][1]


_BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}

#: ggml types that exist but that asyncpaged does not read (named in the error).
_KNOWN_UNSUPPORTED: dict[int, str] = {
    3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


class ValueType(enum.IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: scalar value type -> numpy dtype (little-endian)
_SCALARS: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}

#: key -> kind ("int", "float", "bool", "str", "[int]", "[float]", "[str]") for the keys every
#: GGUF reader relies on; a present key of another kind is a GGUFError.
GENERAL_SCHEMA: dict[str, str] = {
    "general.architecture": "str",
    "general.name": "str",
    "general.alignment": "int",
    "general.file_type": "int",
    "general.quantization_version": "int",
    "split.no": "int",
    "split.count": "int",
    "split.tensors.count": "int",
    "tokenizer.ggml.model": "str",
    "tokenizer.ggml.pre": "str",
    "tokenizer.ggml.tokens": "[str]",
    "tokenizer.ggml.token_type": "[int]",
    "tokenizer.ggml.scores": "[float]",
    "tokenizer.ggml.merges": "[str]",
    "tokenizer.ggml.bos_token_id": "int",
    "tokenizer.ggml.eos_token_id": "int",
    "tokenizer.ggml.unknown_token_id": "int",
    "tokenizer.ggml.padding_token_id": "int",
    "tokenizer.ggml.eot_token_id": "int",
    "tokenizer.ggml.eom_token_id": "int",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.ggml.add_space_prefix": "bool",
    "tokenizer.chat_template": "str",
}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GGUFTensor:
    """One stored tensor: where its bytes are, and what they hold.

    Invariants (checked by ``open_gguf``): ``data`` is exactly ``nbytes`` bytes lying wholly inside
    the data section of ``path``, at an aligned ``offset``, overlapping no other tensor;
    ``shape[-1]`` is a multiple of ``qtype.block_size``; ``nbytes == num_rows * row_bytes``.

    Two transforms, recorded rather than applied to the bytes (set by ``gguf_checkpoint``; the
    identity here): ``row_permutation``, for llama's Q and K projections: index ``i`` along the
    first dimension of the tensor as transformers holds it is stored index ``row_permutation[i]``
    (for a 2-D weight, whole rows of ``row_bytes`` bytes: quantization blocks stay intact); and
    ``value_offset``, added to every value (Gemma's norm weights, stored plus one).
    """

    name: str
    qtype: GGMLType
    shape: tuple[int, ...]  # torch order: GGUF's ne reversed; shape[-1] is the row length
    nbytes: int
    data: np.ndarray  # uint8 [nbytes], a read-only view of the mapped file
    path: Path
    offset: int  # absolute byte offset of data in path
    row_permutation: tuple[int, ...] | None = None
    value_offset: float = 0.0

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.qtype.block_size * self.qtype.type_size

    def rows(self) -> np.ndarray:
        """The bytes as a read-only ``uint8 [num_rows, row_bytes]`` view (stored row order)."""
        return self.data.reshape(self.num_rows, self.row_bytes)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GGUFFile:
    """A validated GGUF file or split set: the first part's metadata and every part's tensors
    (by name, in file order). The mapped files stay open while any tensor view is alive."""

    paths: tuple[Path, ...]
    version: int
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{str(self.paths[0])!r}: no general.architecture in the metadata.")
        return arch


def split_paths(path: str | Path) -> tuple[Path, ...]:
    """All parts of the split set ``path`` belongs to (any part names the set), or ``(path,)``
    for a file not named ``<stem>-NNNNN-of-MMMMM.gguf``. GGUFError when a part is missing."""
    file = Path(path)
    match = _SPLIT_NAME.match(file.name)
    if match is None:
        return (file,)
    count, number = int(match["count"]), int(match["no"])
    if not 1 <= number <= count:
        raise GGUFError(f"{str(file)!r}: part number {number} is not within 1..{count}.")
    parts = tuple(
        file.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    )
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split set {str(parts[0])!r} of {count} parts is missing {missing}.")
    return parts


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate a GGUF file, or the split set it is a part of (see the module
    docstring for every check). Raises GGUFError, UnsupportedModelError, or FileNotFoundError
    when ``path`` does not exist."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(file)!r}.")
    parts = split_paths(file)
    parsed = [_parse(p) for p in parts]
    first = parsed[0]
    count = len(parts)
    for index, (part, (_, metadata, _)) in enumerate(zip(parts, parsed, strict=True)):
        stated = metadata.get("split.count", 1)
        if stated != count:
            raise GGUFError(
                f"{str(part)!r}: split.count is {stated}, but the set has {count} part(s)."
            )
        if metadata.get("split.no", 0) != index:
            raise GGUFError(
                f"{str(part)!r}: split.no is {metadata.get('split.no', 0)}, expected {index} "
                "(0-based, from the file name)."
            )
        if index and metadata.get("split.tensors.count") != first[1].get("split.tensors.count"):
            raise GGUFError(f"{str(part)!r}: split.tensors.count differs from the first part's.")
    tensors: dict[str, GGUFTensor] = {}
    for part, (_, _, part_tensors) in zip(parts, parsed, strict=True):
        for tensor in part_tensors:
            if tensor.name in tensors:
                raise GGUFError(
                    f"{str(part)!r}: tensor {tensor.name!r} appears twice "
                    f"(also in {str(tensors[tensor.name].path)!r})."
                )
            tensors[tensor.name] = tensor
    total = first[1].get("split.tensors.count")
    if total is not None and total != len(tensors):
        raise GGUFError(
            f"{str(parts[0])!r}: split.tensors.count is {total}, but the set holds "
            f"{len(tensors)} tensors."
        )
    return GGUFFile(paths=parts, version=first[0], metadata=first[1], tensors=tensors)


def check_metadata_types(path: Path, metadata: Mapping[str, Any], schema: Mapping[str, str]
                         ) -> None:  # fmt: skip
    """GGUFError for the first key of ``schema`` present in ``metadata`` with another kind."""
    for key, kind in schema.items():
        if key in metadata and not _is_kind(metadata[key], kind):
            raise GGUFError(
                f"{str(path)!r}: metadata key {key!r} should be {_KIND_WORDS[kind]}, got "
                f"{_describe(metadata[key])}."
            )


_KIND_WORDS = {
    "int": "an integer",
    "float": "a float",
    "bool": "a bool",
    "str": "a string",
    "[int]": "an array of integers",
    "[float]": "an array of floats",
    "[str]": "an array of strings",
}


def _is_scalar_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, float)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, str)


def _is_kind(value: Any, kind: str) -> bool:
    if kind.startswith("["):
        return isinstance(value, list) and all(_is_scalar_kind(v, kind[1:-1]) for v in value)
    return _is_scalar_kind(value, kind)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        inner = sorted({type(v).__name__ for v in value})
        return f"an array of {'/'.join(inner) or 'nothing'}"
    return f"{type(value).__name__} {value!r}"[:80]


class _Cursor:
    """Bounded little-endian reads over one mapped file; every read past the end is a GGUFError
    saying what was being read."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.path = path
        self.pos = 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{str(self.path)!r}: {what}.")

    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, num_bytes: int, what: str) -> int:
        """Advance past ``num_bytes`` and return where they start."""
        if num_bytes < 0 or num_bytes > self.remaining():
            raise self.fail(
                f"truncated: {what} needs {num_bytes} bytes at byte {self.pos}, but the file "
                f"has {self.remaining()} left"
            )
        start = self.pos
        self.pos += num_bytes
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buffer, start)[0]

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", what))

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", what))

    def string(self, what: str, max_bytes: int | None = None) -> str:
        length = self.u64(f"the length of {what}")
        if max_bytes is not None and length > max_bytes:
            raise self.fail(f"{what} is {length} bytes long, more than the {max_bytes} allowed")
        start = self.take(length, what)
        try:
            return bytes(self.buffer[start : start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason})") from None

    def value(self, value_type: int, what: str, *, in_array: bool = False) -> Any:
        vtype = self._value_type(value_type, what)
        if vtype is ValueType.STRING:
            return self.string(what)
        if vtype is ValueType.ARRAY:
            if in_array:
                raise self.fail(f"{what} is an array of arrays, which asyncpaged does not read")
            return self.array(what)
        dtype = np.dtype(_SCALARS[vtype])
        start = self.take(dtype.itemsize, what)
        item = np.frombuffer(self.buffer, dtype=dtype, count=1, offset=start)[0]
        return self._scalar(vtype, item, what)

    def array(self, what: str) -> list[Any]:
        element_type = self._value_type(self.u32(f"the element type of {what}"), what)
        count = self.u64(f"the length of {what}")
        if element_type is ValueType.ARRAY:
            raise self.fail(f"{what} is an array of arrays, which asyncpaged does not read")
        if element_type is ValueType.STRING:
            if count > self.remaining() // 8:  # each string takes at least its u64 length
                raise self.fail(
                    f"truncated: {what} claims {count} strings, more than the "
                    f"{self.remaining()} bytes left could hold"
                )
            return [self.string(f"{what}[{i}]") for i in range(count)]
        dtype = np.dtype(_SCALARS[element_type])
        if count > self.remaining() // dtype.itemsize:
            raise self.fail(
                f"truncated: {what} claims {count} elements of {element_type.name}, more than "
                f"the {self.remaining()} bytes left could hold"
            )
        start = self.take(count * dtype.itemsize, what)
        items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start)
        if element_type is ValueType.BOOL:
            if count and int(items.max()) > 1:
                raise self.fail(f"{what} holds a bool that is neither 0 nor 1")
            return [bool(v) for v in items.tolist()]
        values: list[Any] = items.tolist()
        return values

    def _value_type(self, value_type: int, what: str) -> ValueType:
        try:
            return ValueType(value_type)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {value_type}") from None

    def _scalar(self, vtype: ValueType, item: Any, what: str) -> Any:
        if vtype is ValueType.BOOL:
            if int(item) > 1:
                raise self.fail(f"{what} is a bool stored as {int(item)}, not 0 or 1")
            return bool(item)
        if vtype in (ValueType.FLOAT32, ValueType.FLOAT64):
            return float(item)
        return int(item)


def _parse(path: Path) -> tuple[int, dict[str, Any], list[GGUFTensor]]:
    """One file: (version, metadata, tensors), every check of the module docstring but the
    split-set ones."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size < 4 + 4 + 8 + 8:
            raise GGUFError(f"{str(path)!r}: truncated: {size} bytes, shorter than a GGUF header.")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buffer, path)
    magic = bytes(buffer[:4])
    cur.take(4, "the magic")
    if magic != GGUF_MAGIC:
        raise cur.fail(f"not a GGUF file: the magic is {magic!r}, not {GGUF_MAGIC!r}")
    version = cur.u32("the version")
    if version == 1:
        raise UnsupportedModelError(
            f"{str(path)!r}: GGUF version 1 is not supported (only 2 and 3); convert it again "
            "with a current llama.cpp."
        )
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise UnsupportedModelError(f"{str(path)!r}: big-endian GGUF files are not supported.")
        raise cur.fail(f"unknown GGUF version {version} (2 and 3 are read)")
    num_tensors = cur.u64("the tensor count")
    num_kv = cur.u64("the metadata count")
    # a metadata pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor entry
    # 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset)
    if num_kv > cur.remaining() // 13:
        raise cur.fail(f"truncated: {num_kv} metadata pairs cannot fit in {size} bytes")
    if num_tensors > cur.remaining() // 32:
        raise cur.fail(f"truncated: {num_tensors} tensor entries cannot fit in {size} bytes")

    metadata: dict[str, Any] = {}
    for i in range(num_kv):
        key = cur.string(f"metadata key #{i}", max_bytes=MAX_KEY_BYTES)
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        value_type = cur.u32(f"the value type of metadata key {key!r}")
        metadata[key] = cur.value(value_type, f"metadata key {key!r}")
    check_metadata_types(path, metadata, GENERAL_SCHEMA)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not (0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise cur.fail(f"general.alignment {alignment} is not a power of two up to {MAX_ALIGNMENT}")

    entries: list[tuple[str, GGMLType, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(num_tensors):
        name = cur.string(f"the name of tensor #{i}", max_bytes=MAX_TENSOR_NAME_BYTES)
        what = f"tensor {name!r}"
        if name in names:
            raise cur.fail(f"{what} appears twice in the tensor table")
        names.add(name)
        num_dims = cur.u32(f"the dimension count of {what}")
        if not 1 <= num_dims <= MAX_DIMS:
            raise cur.fail(f"{what} has {num_dims} dimensions (1 to {MAX_DIMS} are valid)")
        ne = tuple(cur.u64(f"dimension {d} of {what}") for d in range(num_dims))
        type_id = cur.u32(f"the type of {what}")
        offset = cur.u64(f"the offset of {what}")
        if any(n == 0 or n >= 1 << 63 for n in ne):
            raise cur.fail(f"{what} has dimensions {list(ne)}; each must be in 1..2**63-1")
        qtype = _tensor_type(type_id, path, name)
        if ne[0] % qtype.block_size:
            raise cur.fail(
                f"{what} of type {qtype.name} has rows of {ne[0]} elements, not a multiple of "
                f"its block size {qtype.block_size}"
            )
        nbytes = math.prod(ne) // qtype.block_size * qtype.type_size
        entries.append((name, qtype, ne[::-1], nbytes, offset))

    data_start = -(-cur.pos // alignment) * alignment
    if entries and data_start > size:
        raise cur.fail(
            f"truncated: the data section would start at byte {data_start}, past the end"
        )
    data_size = size - data_start
    array = np.frombuffer(buffer, dtype=np.uint8)
    tensors: list[GGUFTensor] = []
    for name, qtype, shape, nbytes, offset in entries:
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} has offset {offset}, not a multiple of {alignment}")
        if offset > data_size or nbytes > data_size - offset:
            raise cur.fail(
                f"tensor {name!r} ({qtype.name}, shape {list(shape)}, {nbytes} bytes at data "
                f"offset {offset}) extends past the end of the data section ({data_size} bytes; "
                "a truncated file?)"
            )
        begin = data_start + offset
        tensors.append(GGUFTensor(name=name, qtype=qtype, shape=shape, nbytes=nbytes,
                                  data=array[begin : begin + nbytes], path=path,
                                  offset=begin))  # fmt: skip
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for before, after in itertools.pairwise(ordered):
        if before.offset + before.nbytes > after.offset:
            raise cur.fail(f"tensors {before.name!r} and {after.name!r} overlap")
    return version, metadata, tensors


def _tensor_type(type_id: int, path: Path, name: str) -> GGMLType:
    try:
        return GGMLType(type_id)
    except ValueError:
        pass
    if type_id in _KNOWN_UNSUPPORTED:
        raise UnsupportedModelError(
            f"{str(path)!r}: tensor {name!r} has type {_KNOWN_UNSUPPORTED[type_id]}, which "
            f"asyncpaged does not read; supported: {[t.name for t in GGMLType]}."
        )
    raise GGUFError(f"{str(path)!r}: tensor {name!r} has unknown tensor type {type_id}.")
