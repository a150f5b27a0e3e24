"""The strict GGUF reader (``model/gguf_file.py``): valid files of every supported type, split
sets, every malformed-file case as a typed error, and a Hypothesis fuzz of the header, metadata
and tensor table (typed errors or success, never another exception)."""

from __future__ import annotations

import itertools
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.model.errors import CheckpointError, GGUFError, UnsupportedModelError
from asyncpaged.model.gguf_file import GGMLType, GGUFTensor, open_gguf, split_paths

gguf = pytest.importorskip("gguf")

STRING, ARRAY, UINT32, INT32, BOOL, FLOAT32 = 8, 9, 4, 5, 7, 6


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_string(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", STRING) + _s(value)


def kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", UINT32, value)


def tensor_info(name: str, ne: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return (_s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", qtype, offset))  # fmt: skip


def gguf_bytes(kvs: list[bytes], infos: list[bytes], data: bytes, *, version: int = 3,
               alignment: int = 32, magic: bytes = b"GGUF") -> bytes:  # fmt: skip
    head = magic + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs)
    head += b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + data


#: the small valid file's tensors: (name, ne (GGUF order), type, nbytes)
SMALL = [
    ("a.weight", (4, 2), GGMLType.F32, 32),
    ("b.weight", (32, 1), GGMLType.Q8_0, 34),
    ("c.weight", (256,), GGMLType.Q4_K, 144),
]


def small_parts(
    **changes: tuple[tuple[int, ...], int, int],
) -> tuple[list[bytes], list[bytes], bytes]:
    """metadata, tensor table and data of a small valid file; ``changes`` overrides a tensor's
    (ne, type, offset) by name (dots as underscores)."""
    rng = np.random.default_rng(0)
    kvs = [kv_string("general.architecture", "llama"), kv_u32("general.alignment", 32)]
    infos, data = [], b""
    for name, stored_ne, qtype, nbytes in SMALL:
        data += b"\0" * (-len(data) % 32)  # the last tensor ends the file
        default = (stored_ne, int(qtype), len(data))
        ne, qtype_id, offset = changes.get(name.replace(".", "_"), default)
        infos.append(tensor_info(name, ne, qtype_id, offset))
        data += rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return kvs, infos, data


def small_file(path: Path, **changes: tuple[tuple[int, ...], int, int]) -> Path:
    path.write_bytes(gguf_bytes(*small_parts(**changes)))
    return path


def test_small_file_reads(tmp_path: Path) -> None:
    file = open_gguf(small_file(tmp_path / "small.gguf"))
    assert file.version == 3 and file.architecture == "llama"
    assert list(file.tensors) == [name for name, *_ in SMALL]
    raw = (tmp_path / "small.gguf").read_bytes()
    for name, ne, qtype, nbytes in SMALL:
        tensor = file.tensors[name]
        assert tensor.qtype is qtype and tensor.shape == ne[::-1] and tensor.nbytes == nbytes
        assert tensor.data.dtype == np.uint8 and not tensor.data.flags.writeable
        assert tensor.data.tobytes() == raw[tensor.offset : tensor.offset + nbytes]
        assert tensor.offset % 32 == 0


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_supported_type_from_gguf_writer(tmp_path: Path, qtype: str) -> None:
    from asyncpaged.testing.tiny_gguf import encode_tensor

    weight = np.random.default_rng(1).standard_normal((3, 2, 512)).astype(np.float32)
    encoded = encode_tensor(weight, qtype)
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    raw_type = gguf.GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16"):
        writer.add_tensor("w", encoded)
    else:
        writer.add_tensor("w", encoded, raw_shape=encoded.shape, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = open_gguf(tmp_path / "t.gguf").tensors["w"]
    assert tensor.qtype.name == qtype and tensor.shape == (3, 2, 512)
    assert tensor.data.tobytes() == encoded.tobytes()
    assert tensor.rows().shape == (6, tensor.row_bytes)
    block, size = gguf.GGML_QUANT_SIZES[raw_type]
    assert (tensor.qtype.block_size, tensor.qtype.type_size) == (block, size)
    reader = gguf.GGUFReader(tmp_path / "t.gguf")  # llama.cpp's reader agrees on where it is
    assert int(reader.tensors[0].data_offset) == tensor.offset


def test_split_set(tmp_path: Path) -> None:
    from asyncpaged.testing.tiny_gguf import write_tiny_gguf

    single = open_gguf(write_tiny_gguf("llama-gqa", tmp_path / "one" / "m.gguf", default="Q8_0"))
    first = write_tiny_gguf("llama-gqa", tmp_path / "split" / "m.gguf", default="Q8_0",
                            split_max_tensors=8)  # fmt: skip
    assert first.name == "m-00001-of-00003.gguf"
    for part in (first, first.with_name("m-00003-of-00003.gguf")):  # any part names the set
        split = open_gguf(part)
        assert [p.name for p in split.paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
        assert list(split.tensors) == list(single.tensors)
        for name, tensor in single.tensors.items():
            assert split.tensors[name].data.tobytes() == tensor.data.tobytes()
        assert split.metadata["tokenizer.ggml.tokens"] == single.metadata["tokenizer.ggml.tokens"]
    first.with_name("m-00002-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="missing"):
        open_gguf(first)


def test_split_metadata_must_agree(tmp_path: Path) -> None:
    kvs, infos, data = small_parts()
    for number, split_no in ((1, 0), (2, 5)):  # the second part says it is part 6
        extra = [kv_u32("split.no", split_no), kv_u32("split.count", 2)]
        name = tmp_path / f"x-0000{number}-of-00002.gguf"
        body = (infos, data) if number == 1 else ([], b"")
        name.write_bytes(gguf_bytes(kvs + extra, *body))
    with pytest.raises(GGUFError, match=r"split\.no is 5"):
        open_gguf(tmp_path / "x-00001-of-00002.gguf")
    (tmp_path / "y.gguf").write_bytes(gguf_bytes([*kvs, kv_u32("split.count", 3)], infos, data))
    with pytest.raises(GGUFError, match=r"split\.count is 3"):
        open_gguf(tmp_path / "y.gguf")
    assert split_paths(tmp_path / "y.gguf") == (tmp_path / "y.gguf",)


def _expect(tmp_path: Path, raw: bytes, error: type[Exception], match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(error, match=match) as info:
        open_gguf(path)
    assert "bad.gguf" in str(info.value)


def test_truncated_at_every_region(tmp_path: Path) -> None:
    raw = gguf_bytes(*small_parts())
    kvs, infos, _ = small_parts()
    header = 24 + sum(map(len, kvs))
    table_end = header + sum(map(len, infos))
    cuts = [0, 3, 4, 10, 23, 30, header - 1, header + 5, table_end - 1, table_end + 1,
            len(raw) - 200, len(raw) - 1]  # fmt: skip
    for cut in cuts:
        _expect(tmp_path, raw[:cut], GGUFError, "truncated|past the end")


def test_bad_tensor_tables(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, tuple[tuple[int, ...], int, int]], type[Exception], str]] = [
        ({"c_weight": ((256,), 12, 1 << 40)}, GGUFError, "extends past the end"),
        ({"c_weight": ((256,), 12, 2**64 - 32)}, GGUFError, "extends past the end"),
        ({"c_weight": ((256,), 12, 8)}, GGUFError, "not a multiple of 32"),
        ({"b_weight": ((32, 1), 8, 0)}, GGUFError, "overlap"),
        ({"a_weight": ((4, 2), 99, 0)}, GGUFError, "unknown tensor type 99"),
        ({"a_weight": ((4, 2), 10, 0)}, UnsupportedModelError, "Q2_K"),
        ({"a_weight": ((), 0, 0)}, GGUFError, "0 dimensions"),
        ({"a_weight": ((1, 1, 1, 1, 8), 0, 0)}, GGUFError, "5 dimensions"),
        ({"a_weight": ((4, 0), 0, 0)}, GGUFError, "dimensions"),
        ({"b_weight": ((16, 2), 8, 64)}, GGUFError, "not a multiple of its block size 32"),
        ({"a_weight": ((2**40, 2**20), 0, 0)}, GGUFError, "extends past the end"),
    ]
    for changes, error, match in cases:
        _expect(tmp_path, gguf_bytes(*small_parts(**changes)), error, match)


def test_duplicates_and_bad_headers(tmp_path: Path) -> None:
    kvs, infos, data = small_parts()
    _expect(tmp_path, gguf_bytes(kvs, [infos[0], infos[0]], data), GGUFError, "appears twice")
    _expect(tmp_path, gguf_bytes(kvs + kvs[:1], infos, data), GGUFError, "appears twice")
    _expect(tmp_path, gguf_bytes(kvs, infos, data, magic=b"GGML"), GGUFError, "magic")
    _expect(tmp_path, gguf_bytes(kvs, infos, data, version=1), UnsupportedModelError, "version 1")
    _expect(tmp_path, gguf_bytes(kvs, infos, data, version=7), GGUFError, "version 7")
    big_endian = 3 << 24
    _expect(tmp_path, gguf_bytes(kvs, infos, data, version=big_endian), UnsupportedModelError,
            "big-endian")  # fmt: skip
    counts = b"GGUF" + struct.pack("<IQQ", 3, 2**63, 2)
    _expect(tmp_path, counts + gguf_bytes(kvs, infos, data)[24:], GGUFError, "cannot fit")


def test_wrong_metadata_types(tmp_path: Path) -> None:
    _, infos, data = small_parts()
    arch = kv_string("general.architecture", "llama")
    cases = [
        ([_s("general.architecture") + struct.pack("<II", UINT32, 5)], "general.architecture"),
        ([arch, kv_string("general.alignment", "32")], "general.alignment"),
        ([arch, _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, INT32, 1) + b"\0" * 4],
         "tokenizer.ggml.tokens"),
        ([arch, _s("x") + struct.pack("<I", 13)], "unknown value type 13"),
        ([arch, _s("x") + struct.pack("<IB", BOOL, 2)], "neither 0 nor 1|not 0 or 1"),
        ([arch, _s("x") + struct.pack("<III", ARRAY, ARRAY, 0)], "array of arrays"),
        ([arch, _s("x") + struct.pack("<IIQ", ARRAY, STRING, 2**40)], "truncated"),
        ([arch, _s(b"\xff\xfe") + struct.pack("<II", UINT32, 1)], "UTF-8"),
        ([arch, kv_u32("general.alignment", 48)], "power of two"),
        ([arch, kv_u32("general.alignment", 0)], "power of two"),
    ]  # fmt: skip
    for kvs, match in cases:
        _expect(tmp_path, gguf_bytes(kvs, infos, data), GGUFError, match)


def test_errors_are_checkpoint_errors() -> None:
    assert issubclass(GGUFError, CheckpointError) and issubclass(GGUFError, ValueError)
    with pytest.raises(FileNotFoundError):
        open_gguf("/nonexistent/model.gguf")


# ---- fuzz -----------------------------------------------------------------------------------

_VALID = gguf_bytes(*small_parts())
_KVS, _INFOS, _ = small_parts()
_TABLE_END = 24 + sum(map(len, _KVS)) + sum(map(len, _INFOS))
_INTERESTING = [0, 1, 2, 3, 4, 5, 31, 32, 33, 255, 256, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]

_mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, _TABLE_END - 1), st.integers(0, 255)),
    st.tuples(st.just("u32"), st.integers(0, _TABLE_END - 4), st.sampled_from(_INTERESTING)),
    st.tuples(st.just("u64"), st.integers(0, _TABLE_END - 8), st.sampled_from(_INTERESTING)),
)


def _mutate(raw: bytes, mutations: list[tuple[str, int, int]], cut: int | None) -> bytes:
    out = bytearray(raw)
    for kind, position, value in mutations:
        if kind == "byte":
            out[position] = value
        elif kind == "u32":
            out[position : position + 4] = struct.pack("<I", value % 2**32)
        else:
            out[position : position + 8] = struct.pack("<Q", value)
    return bytes(out if cut is None else out[:cut])


@settings(max_examples=500, deadline=None)
@given(
    mutations=st.lists(_mutation, min_size=0, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(_VALID))),
)
def test_fuzz_header_and_tensor_table(mutations: list[tuple[str, int, int]], cut: int | None
                                      ) -> None:  # fmt: skip
    raw = _mutate(_VALID, mutations, cut)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.gguf"
        path.write_bytes(raw)
        try:
            file = open_gguf(path)
        except (GGUFError, UnsupportedModelError):
            return
        spans = []
        for tensor in file.tensors.values():
            assert isinstance(tensor, GGUFTensor)
            assert tensor.data.nbytes == tensor.nbytes == tensor.num_rows * tensor.row_bytes
            assert tensor.offset >= 0 and tensor.offset + tensor.nbytes <= len(raw)
            assert tensor.data.tobytes() == raw[tensor.offset : tensor.offset + tensor.nbytes]
            spans.append((tensor.offset, tensor.offset + tensor.nbytes))
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
