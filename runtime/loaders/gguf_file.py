"""A GGUF file's metadata and tensor directory, read in milliseconds (torch-free).

gguf.GGUFReader builds a numpy view for every element of every metadata array: for a model
whose tokenizer is stored in the file (SmolLM2: 49,152 tokens and 48,900 merges) that is about
a million memmap slices, 1.5-3 s on a 2-core VM, paid by every worker that loads the model and
by the launcher's preflight. The loader needs the scalars and the tensor directory only, so this
reader walks the same layout (GGUF v2/v3: header, key/value pairs, tensor infos, aligned data)
with struct over one read-only mmap, keeps arrays as (type, count, offset) until asked, and
hands out tensors as numpy views of the mapping with GGUFReader's shapes (quantised rows as
bytes), so gguf.quants.dequantize takes them as before. Field objects answer `contents()` like
GGUFReader's; an array field's `data` has the array's length.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
# The block formats `--quantization gguf` multiplies in place (runtime/layers/group_quant.py).
KEPT_BLOCK_TYPES = tuple(gguf.GGMLQuantizationType[name] for name in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
_DEFAULT_ALIGNMENT = 32
VT = gguf.GGUFValueType
_SCALARS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
            VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
            VT.FLOAT64: "<d"}
_NUMPY = {VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16,
          VT.UINT32: np.uint32, VT.INT32: np.int32, VT.FLOAT32: np.float32, VT.BOOL: np.bool_,
          VT.UINT64: np.uint64, VT.INT64: np.int64, VT.FLOAT64: np.float64}
# Unquantised tensor types and the numpy dtype of their elements.
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


class _Cursor:
    def __init__(self, buffer, path: str) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"{self.path}: truncated GGUF file") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError(f"{self.path}: truncated GGUF file")
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            length = self.unpack("<Q")      # (advances past the length first)
            self.offset += length


@dataclass(frozen=True)
class _ArrayData:
    """An array value not yet read: its element type, length and where it starts."""

    element_type: VT
    count: int
    offset: int
    file: GGUFFile

    def __len__(self) -> int:
        return self.count

    def values(self) -> list:
        cursor = _Cursor(self.file.buffer, self.file.path)
        cursor.offset = self.offset
        if self.element_type == VT.STRING:
            return [cursor.string() for _ in range(self.count)]
        if self.element_type == VT.ARRAY:
            raise ValueError(f"{self.file.path}: nested GGUF arrays are not read")
        return np.frombuffer(self.file.buffer, _NUMPY[self.element_type], self.count,
                             self.offset).tolist()


@dataclass(frozen=True)
class Field:
    name: str
    value: Any                  # a scalar or string, or _ArrayData

    @property
    def data(self) -> Any:
        return self.value

    def contents(self) -> Any:
        return self.value.values() if isinstance(self.value, _ArrayData) else self.value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: np.ndarray           # GGUF order: innermost dimension first (as GGUFReader's)
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray            # a read-only view of the mapping (quantised: rows of bytes)


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as handle:
            self.buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(self.buffer, path)
        if bytes(self.buffer[:4]) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        cursor.offset = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(num_fields):
            name = cursor.string()
            self.fields[name] = Field(name, self._value(cursor, VT(cursor.unpack("<I"))))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", Field("", _DEFAULT_ALIGNMENT)).value)
        start = -(-cursor.offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _value(self, cursor: _Cursor, value_type: VT) -> Any:
        if value_type == VT.STRING:
            return cursor.string()
        if value_type != VT.ARRAY:
            return cursor.unpack(_SCALARS[value_type])
        element_type, count = VT(cursor.unpack("<I")), cursor.unpack("<Q")
        array = _ArrayData(element_type, count, cursor.offset, self)
        if element_type == VT.STRING:
            cursor.skip_strings(count)
        elif element_type == VT.ARRAY:
            raise ValueError(f"{self.path}: nested GGUF arrays are not supported")
        else:
            cursor.offset += count * np.dtype(_NUMPY[element_type]).itemsize
        return array

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple:
        name = cursor.string()
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        return name, dims, gguf.GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")

    def _tensor(self, data_start: int, name: str, dims: list[int],
                tensor_type: gguf.GGMLQuantizationType, offset: int) -> TensorInfo:
        count = int(np.prod(dims)) if dims else 1
        if tensor_type in _PLAIN:
            dtype, size = _PLAIN[tensor_type], count
            shape = tuple(reversed(dims))
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            row_bytes = dims[0] // block * block_bytes
            dtype, size = np.uint8, count // dims[0] * row_bytes
            shape = tuple(reversed(dims[1:])) + (row_bytes,)
        end = data_start + offset + size * np.dtype(dtype).itemsize
        if end > len(self.buffer):
            raise ValueError(f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte "
                             f"{end:,}, the file has {len(self.buffer):,}")
        data = np.frombuffer(self.buffer, dtype, size, data_start + offset).reshape(shape)
        return TensorInfo(name, np.array(dims, dtype=np.uint64), tensor_type, data)


def quantized_layer_types(path: str) -> list[str]:
    """The kept block types (by name, sorted) of the file's layer weights (`blk.N.*`): what
    `--quantization auto` keeps in blocks; [] for a file whose layers are F32, F16 or BF16."""
    return sorted({t.tensor_type.name for t in GGUFFile(path).tensors
                   if t.name.startswith("blk.") and t.tensor_type in KEPT_BLOCK_TYPES})
