"""The GGUF metadata walk against gguf's own reader, which parses every array."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from tandem.engine.gguf_meta import read_gguf_meta
from tandem.engine.loader import smollm2_gguf_path


def _reader_view(path: Path) -> tuple[dict, list[str]]:
    """What read_gguf_meta should give: GGUFReader's fields less its arrays and its own
    header entries, and its tensors' names."""
    reader = GGUFReader(str(path))
    fields = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and field.types[0] != GGUFValueType.ARRAY
    }
    return fields, [t.name for t in reader.tensors]


def test_the_default_models_metadata_is_read_as_ggufs_reader_reads_it():
    path = smollm2_gguf_path()
    meta = read_gguf_meta(path)
    fields, names = _reader_view(path)
    assert meta.fields == fields and meta.tensor_names == names
    assert meta.fields["general.architecture"] == "llama" and len(names) == 272


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_and_array_in_either_byte_order(tmp_path, endian):
    path = tmp_path / "all.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    scalars = {
        GGUFValueType.UINT8: 200, GGUFValueType.INT8: -100, GGUFValueType.UINT16: 60000,
        GGUFValueType.INT16: -30000, GGUFValueType.UINT32: 4_000_000_000,
        GGUFValueType.INT32: -2_000_000_000, GGUFValueType.FLOAT32: 0.5,
        GGUFValueType.BOOL: True, GGUFValueType.UINT64: 2**63 + 5,
        GGUFValueType.INT64: -(2**62), GGUFValueType.FLOAT64: 1e300,
    }  # fmt: skip
    for kind, value in scalars.items():
        writer.add_key_value(f"t.{kind.name.lower()}", value, kind)
    writer.add_string("t.text", "ünïcode, and after the arrays: ")
    writer.add_array("t.strings", ["a", "", "bcd" * 100])
    writer.add_array("t.ints", list(range(1000)))
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.after", "still found")
    writer.add_tensor("blk.0.weight", np.ones((4, 8), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_gguf_meta(path)
    assert (meta.fields, meta.tensor_names) == _reader_view(path)
    assert meta.fields["t.uint64"] == 2**63 + 5 and meta.fields["t.after"] == "still found"
    assert meta.tensor_names == ["blk.0.weight", "rope_freqs.weight"]


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_value_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf_meta(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf_path().read_bytes()[:100_000])  # in the vocabulary
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf_meta(cut)


def test_arrays_nested_past_any_sane_depth_and_a_cut_tensor_table_are_value_errors(tmp_path):
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    deep = tmp_path / "deep.gguf"  # 2,000 arrays, each holding the next
    deep.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("deep")
                     + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000
                     + struct.pack("<IQ", 0, 0))  # fmt: skip
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf_meta(deep)
    last = GGUFReader(str(smollm2_gguf_path())).tensors[-1]
    whole = smollm2_gguf_path().read_bytes()
    end = whole.rindex(string(last.name)) + len(string(last.name)) + 4 + 8 * len(last.shape) + 12
    cut = tmp_path / "cut.gguf"  # in the last entry of the tensors' table, past its dims
    cut.write_bytes(whole[: end - 10])
    with pytest.raises(ValueError, match="the tensors' table runs past the end"):
        read_gguf_meta(cut)
