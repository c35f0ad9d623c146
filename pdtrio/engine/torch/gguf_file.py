"""A GGUF file read in one pass: its metadata as plain values, its tensors as memory-mapped
bytes, dequantised a whole tensor at a time.

``gguf.GGUFReader`` builds a numpy memmap view per metadata element (SmolLM2's 98,000
vocabulary and merge strings took 8 s of a 15 s load), and ``gguf.quants.dequantize``
works 16 rows at a time; this reads the same file layout with ``struct`` and
dequantises each tensor in a few whole-array numpy operations, the same ones in the
same order as gguf's, so the values are bit for bit gguf's. Types without a routine
here go to ``gguf.quants.dequantize``. Little-endian GGUF v2 and v3 only (what
llama.cpp writes); anything else raises :class:`GGUFFormatError` and the caller may
fall back to ``gguf.GGUFReader``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, final

import attrs
import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)

_SCALARS: dict[int, struct.Struct] = {
    _UINT8: struct.Struct("<B"),
    _INT8: struct.Struct("<b"),
    _UINT16: struct.Struct("<H"),
    _INT16: struct.Struct("<h"),
    _UINT32: struct.Struct("<I"),
    _INT32: struct.Struct("<i"),
    _FLOAT32: struct.Struct("<f"),
    _BOOL: struct.Struct("<?"),
    _UINT64: struct.Struct("<Q"),
    _INT64: struct.Struct("<q"),
    _FLOAT64: struct.Struct("<d"),
}
_NUMPY: dict[int, str] = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "?",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader handles."""


@final
@attrs.frozen(eq=False)
class GGUFTensor:
    """One tensor: its name, GGML type, shape as torch sees it (outermost first), raw bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, a read-only view of the mapped file


@final
@attrs.frozen(eq=False)
class GGUFFile:
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``: metadata (python values; arrays as lists) and tensor views.

    ``fields`` holds what ``gguf.GGUFReader``'s fields hold (``_native(contents())``).
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file
            raise GGUFFormatError(f"cannot map the file: {exc}") from exc
    buf = memoryview(mapped)
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFFormatError("no GGUF magic")
    if len(buf) < 24:
        raise GGUFFormatError("the file is too short for a GGUF header")
    (version,) = _U32.unpack_from(buf, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (little-endian 2 and 3 are read)")
    (tensor_count,) = _U64.unpack_from(buf, 8)
    (kv_count,) = _U64.unpack_from(buf, 16)
    reader = _Cursor(buf, 24)
    # (the header's own three as gguf.GGUFReader lists them first)
    fields: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    for _ in range(kv_count):
        key = reader.string()
        (value_type,) = reader.unpack(_U32)
        fields[key] = reader.value(value_type)
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = reader.string()
        (n_dims,) = reader.unpack(_U32)
        dims = tuple(reader.unpack(_U64)[0] for _ in range(n_dims))
        (ggml_type,) = reader.unpack(_U32)
        (offset,) = reader.unpack(_U64)
        infos.append((name, dims, ggml_type, offset))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFFormatError(f"general.alignment = {alignment!r}")
    data_start = -(-reader.pos // alignment) * alignment
    raw = np.frombuffer(mapped, dtype=np.uint8)
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {ggml_type}") from exc
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if elements % block_size:
            raise GGUFFormatError(f"tensor {name!r}: {elements} elements, blocks of {block_size}")
        size = elements // block_size * type_size
        start = data_start + offset
        if start + size > len(raw):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        tensors[name] = GGUFTensor(
            name, ggml_type, tuple(int(d) for d in reversed(dims)), raw[start : start + size]
        )
    return GGUFFile(fields=fields, tensors=tensors)


class _Cursor:
    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        try:
            values = fmt.unpack_from(self.buf, self.pos)
        except struct.error as exc:
            raise GGUFFormatError(f"truncated at byte {self.pos}") from exc
        self.pos += fmt.size
        return values

    def string(self) -> str:
        (length,) = self.unpack(_U64)
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFFormatError(f"a string runs past the end of the file at byte {self.pos}")
        text = str(self.buf[self.pos : end], encoding="utf-8")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            return self.unpack(scalar)[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            (item_type,) = self.unpack(_U32)
            (count,) = self.unpack(_U64)
            numeric = _NUMPY.get(item_type)
            if numeric is not None:
                dtype = np.dtype(numeric)
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array runs past the end at byte {self.pos}")
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return items.tolist()
            if item_type == _STRING:
                return self._strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {value_type}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (length,) = unpack(buf, pos)
                pos += 8
                append(str(buf[pos : pos + length], encoding="utf-8"))
                pos += length
        except struct.error as exc:
            raise GGUFFormatError("a string array runs past the end of the file") from exc
        if pos > len(buf):
            raise GGUFFormatError("a string array runs past the end of the file")
        self.pos = pos
        return out


# --- dequantisation -------------------------------------------------------------------
# Each takes the tensor's blocks [n, type_size] (uint8) and returns float32 [n, block_size],
# computing what gguf.quants' dequantize_blocks computes, over every block at once.


def _f16(column: np.ndarray) -> np.ndarray:
    """Two-byte columns [n, 2] read as float16 [n, 1], widened to float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, k] as their low nibbles then their high ones: [n, 2k] uint8."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype=np.uint8)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, : qs.shape[1]])
    np.right_shift(qs, np.uint8(4), out=out[:, qs.shape[1] :])
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    qs = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return d * qs.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    qs = _nibbles(blocks[:, 4:]).astype(np.float32)
    out = np.multiply(d, qs, out=qs)
    return np.add(out, m, out=out)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    x = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return np.multiply(x, d, out=x)


def _f16_blocks(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _bf16_blocks(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.int16).astype(np.int32) << 16).view(np.float32)


_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
_DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    _F16: _f16_blocks,
    _Q4_0: _q4_0,
    _Q4_1: _q4_1,
    _Q8_0: _q8_0,
    _BF16: _bf16_blocks,
}


def fast_dequantizable(ggml_type: int) -> bool:
    """Whether :func:`dequantize` has its own whole-tensor routine for this type."""
    return ggml_type == _F32 or ggml_type in _DEQUANTIZERS


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as a writable float32 array of its shape (a copy, never the file's bytes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType(tensor.ggml_type)
    if tensor.ggml_type == _F32:
        values = tensor.data.view(np.float32).copy()
    elif (routine := _DEQUANTIZERS.get(tensor.ggml_type)) is not None:
        _, type_size = GGML_QUANT_SIZES[qtype]
        values = routine(tensor.data.reshape(-1, type_size))
    else:
        values = gguf_dequantize(tensor.data, qtype).astype(np.float32, copy=False)
        if not values.flags.writeable:
            values = values.copy()
    return values.reshape(tensor.shape)
