"""A GGUF file's scalar and string metadata and its tensors' names, without its arrays.

gguf's ``GGUFReader`` turns every element of every array field into numpy views as it
opens a file: for the default model's 49k-token vocabulary and its merges that is
about 3 s, paid each time a setting is looked up (the router's RoPE scaling on a
first start, the build's). This walks the same layout (GGUF v2/v3, either byte
order) and steps over arrays by their lengths: milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"GGUF"
# GGUFValueType -> struct format of one value (STRING = 8 and ARRAY = 9 are not fixed)
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufMeta:
    fields: dict[str, int | float | bool | str]  # array fields are left out
    tensor_names: list[str]


def read_gguf_meta(path: str | Path) -> GgufMeta:
    """The scalar and string fields of the GGUF file at ``path``, and its tensors'
    names. ValueError for a file that is not GGUF (or is cut short)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Walk(data).meta()
        except (struct.error, UnicodeDecodeError, IndexError, RecursionError) as exc:
            raise ValueError(f"not a readable GGUF file: {exc}") from None


class _Walk:
    def __init__(self, data: mmap.mmap) -> None:
        if data[:4] != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.data = data
        self.offset = 4
        # A file written for the other byte order reads its version as v << 16.
        self.order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
        version = self.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not one this reads (2, 3)")

    def take(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.data, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.offset += n
        if self.offset > len(self.data):
            raise IndexError("a string runs past the end of the file")
        return self.data[self.offset - n : self.offset].decode()

    def skip(self, kind: int) -> None:
        if kind in _FIXED:
            self.offset += struct.calcsize(_FIXED[kind])
        elif kind == _STRING:
            n = self.take("Q")  # before the +=, which would read the offset before it
            self.offset += n
        elif kind == _ARRAY:
            element, count = self.take("I"), self.take("Q")
            if element in _FIXED:  # one step over the lot
                self.offset += count * struct.calcsize(_FIXED[element])
            else:
                for _ in range(count):
                    self.skip(element)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset}")
        if self.offset > len(self.data):
            raise IndexError("a value runs past the end of the file")

    def meta(self) -> GgufMeta:
        tensors, kvs = self.take("Q"), self.take("Q")
        fields: dict[str, int | float | bool | str] = {}
        for _ in range(kvs):
            key, kind = self.string(), self.take("I")
            if kind in _FIXED:
                fields[key] = self.take(_FIXED[kind])
            elif kind == _STRING:
                fields[key] = self.string()
            else:
                self.skip(kind)
        names = []
        for _ in range(tensors):
            names.append(self.string())
            dims = self.take("I")
            self.offset += 8 * dims + 4 + 8  # the dims, the type, the data's offset
        if self.offset > len(self.data):
            raise IndexError("the tensors' table runs past the end of the file")
        return GgufMeta(fields, names)
