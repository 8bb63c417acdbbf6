"""The fast GGUF directory reader (runtime/loaders/gguf_file.py) against gguf's own GGUFReader:
the same fields, tensor names, types, shapes and bytes, on the embedded SmolLM2 file and on a
small file written with every value type; and clear errors for what is not GGUF."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from spmd_runtime.runtime.loaders.gguf_file import GGUFFile


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path, "r")
    expected_fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected_fields)
    for key, field in expected_fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert len(ours.fields[key].data) == len(field.data), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (reference.name, reference.tensor_type)
        assert mine.shape.tolist() == reference.shape.tolist(), mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


@pytest.mark.slow
def test_the_embedded_smollm2_file_reads_as_gguf_reads_it(smollm2_gguf) -> None:
    directory, name = smollm2_gguf
    assert_same_as_gguf_reader(str(directory / name))


def test_every_value_type_and_tensor_layout(tmp_path) -> None:
    path = str(tmp_path / "small.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strs", ["a", "", "ccc"])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 4)).astype(np.float16))
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("quantised", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)
    quantised = GGUFFile(path).tensors[2]
    np.testing.assert_allclose(gguf.quants.dequantize(np.asarray(quantised.data),
                                                      quantised.tensor_type), weights, atol=0.05)


def test_what_is_not_gguf_is_refused_by_name(tmp_path) -> None:
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(not_gguf))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little")
                          + (5).to_bytes(8, "little") + (100).to_bytes(8, "little") + b"ab")
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(str(truncated))
