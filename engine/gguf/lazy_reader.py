"""gguf-py's GGUFReader with its metadata arrays made only when read.

GGUFReader makes every item of every metadata array a numpy view of the mapping as it opens a
file: a 49k-token vocabulary with its merges is some 250k views, about 2.5 s and tens of MB of
heap that stay as long as the reader (which holds the mapping) does. The engine reads only scalar
fields (the tokenizer comes from the companion folder: engine/gguf/folder.py), so here an array's
items are found by walking their lengths once and made when a caller asks, as the same views, in
the same `ReaderField` layout: `contents()` and `parts` give what gguf-py's give.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


class LazyReader(GGUFReader):
    def _get(self, offset, dtype, count=1, override_order=None):
        # as gguf-py's, over a plain view of the mapping: a slice of np.memmap costs its
        # __array_finalize__ in Python, which was most of the time of a file's metadata
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        arr = self._plain()[offset : offset + itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_view")
        if plain is None:
            plain = self._plain_view = self.data.view(np.ndarray)
        return plain

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            start = offs
            key_len, key = self._get_str(offs)
            offs += int(key_len.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head = [key_len, key, raw_type]
            array = self._array(head, offs) if raw_type[0] == GGUFValueType.ARRAY else None
            if array is None:
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                parts, idxs = head + parts, [i + len(head) for i in idxs]
            else:
                size, parts, idxs, types = array
            self._push_field(
                ReaderField(start, str(bytes(key), encoding="utf-8"), parts, idxs, types),
                skip_sum=True,
            )
            offs += size
        return offs

    def _array(self, head: list, offs: int):
        """(size, parts, data indices, types) of the array at offs, its items' parts lazy; None for
        an array of arrays (gguf-py's own reading)."""
        item_type = self._get(offs, np.uint32)
        length = self._get(offs + 4, np.uint64)
        first = offs + 12
        n = int(length[0])
        kind = GGUFValueType(int(item_type[0]))
        head = [*head, item_type, length]
        if kind == GGUFValueType.STRING:
            if n > (len(self._plain()) - first) // 8:  # each string has 8 bytes of length
                raise ValueError(f"a metadata array of {n} strings runs past the end of the file")
            starts, end = self._string_starts(first, n)
            parts = _ItemParts(self, head, starts, None)
            return (
                end - offs,
                parts,
                range(len(head) + 1, len(head) + 2 * n, 2),
                [GGUFValueType.ARRAY, kind],
            )
        dtype = self.gguf_scalar_to_np.get(kind)
        if dtype is None:
            return None
        itemsize = np.dtype(dtype).itemsize
        if first + itemsize * n > len(self._plain()):
            raise ValueError(f"a metadata array of {n} items runs past the end of the file")
        parts = _ItemParts(self, head, first + itemsize * np.arange(n, dtype=np.int64), dtype)
        return (
            12 + itemsize * n,
            parts,
            range(len(head), len(head) + n),
            [GGUFValueType.ARRAY, kind],
        )

    def _length_at(self, offset: int) -> int:
        return int(self._get(offset, np.uint64)[0])

    def _string_starts(self, offset: int, n: int) -> tuple[np.ndarray, int]:
        """The offsets of n length-prefixed strings from offset, and where they end: one walk over
        their lengths."""
        data = memoryview(self._plain())
        order = "big" if self.byte_order == "S" and np.little_endian else "little"
        starts = np.empty(n, dtype=np.int64)
        for i in range(n):
            starts[i] = offset
            offset += 8 + int.from_bytes(data[offset : offset + 8], order)
        if offset > len(data):
            raise ValueError("a metadata string runs past the end of the file")
        return starts, offset


class _ItemParts(Sequence):
    """An array field's parts in gguf-py's layout, [key length, key, type, item type, count, then
    each item's parts (a string: its length and its bytes; a scalar: itself)], items made when
    read."""

    def __init__(self, reader: LazyReader, head: list, starts: np.ndarray, dtype):
        self.reader, self.head, self.starts, self.dtype = reader, head, starts, dtype
        self.per_item = 2 if dtype is None else 1

    def __len__(self) -> int:
        return len(self.head) + self.per_item * len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if index < len(self.head):
            return self.head[index]
        item, which = divmod(index - len(self.head), self.per_item)
        start = int(self.starts[item])
        if self.dtype is not None:
            return self.reader._get(start, self.dtype)
        if which == 0:
            return self.reader._get(start, np.uint64)
        return self.reader._get(start + 8, np.uint8, self.reader._length_at(start))
