"""Read a GGUF file: its metadata, its tensor table, and any tensor dequantised to float32.

GGUF (llama.cpp's single-file format): the magic ``GGUF``, a version (2 or 3), the tensor and
key/value counts, the key/value metadata, one info record per tensor (name, dims, type, offset),
then the aligned tensor data. The header is parsed here with ``struct`` over one memory map
rather than ``gguf.GGUFReader``, which builds a numpy view per array element (SmolLM2's
98,000 tokens and merges: tens of seconds against well under one here) and reports a damaged
file as an ``IndexError``. Every problem (not GGUF, big-endian, an old version, cut short, a
tensor past the end) is a :class:`~needle.errors.ModelImportError` naming the file and what is
wrong. Dequantisation is ``gguf.quants.dequantize`` (llama.cpp's own Python reference).

    f = read_gguf("model.gguf")
    f.metadata["general.architecture"]     # "llama"
    w = f.tensor("blk.0.attn_q.weight")    # float32, numpy layout (GGUF dims reversed: [out, in])
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from needle.errors import ModelImportError

MAGIC = b"GGUF"
# Tensor types needle dequantises (each checked against gguf.quants in tests/model/test_gguf_import.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's record: GGUF dims (innermost first), ggml type name, byte range in the file."""

    name: str
    dims: tuple[int, ...]
    type_name: str
    start: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape: GGUF lists the innermost dimension first."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    """A parsed GGUF file; :meth:`tensor` reads and dequantises one tensor on demand."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap = field(repr=False)

    def fail(self, why: str) -> ModelImportError:
        return ModelImportError(f"{self.path}: {why}")

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array in numpy layout (a fresh copy, not a view of the file)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        if info.type_name not in SUPPORTED_TYPES:
            raise self.fail(f"tensor {name} has type {info.type_name}; needle reads {', '.join(SUPPORTED_TYPES)}")
        raw = np.frombuffer(self._map, np.uint8, count=info.nbytes, offset=info.start)
        qtype = GGMLQuantizationType[info.type_name]
        if info.type_name in ("F32", "F16"):
            data = raw.view(np.float32 if info.type_name == "F32" else np.float16).reshape(info.shape)
            return data.astype(np.float32)  # astype copies: the result does not pin the memory map
        rows = raw.reshape(*info.shape[:-1], -1)
        return np.ascontiguousarray(dequantize(rows, qtype), dtype=np.float32).reshape(info.shape)


class _Cursor:
    """Little-endian reads over the memory map; running past its end is a truncated file."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelImportError(f"{self.path}: truncated: the header ends past the file's {len(self.buf)} bytes")
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, code: int) -> Any:
        fmt = _SCALARS[code]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, n = self.scalar(4), self.scalar(10)
            if item == STRING:
                return [self.string() for _ in range(n)]
            if item not in _NP:
                raise ModelImportError(f"{self.path}: array of unknown value type {item} in the metadata")
            return np.frombuffer(self.take(n * np.dtype(_NP[item]).itemsize), _NP[item]).tolist()
        if kind not in _SCALARS:
            raise ModelImportError(f"{self.path}: unknown metadata value type {kind} (damaged header?)")
        return self.scalar(kind)


def is_gguf_file(path: str | Path) -> bool:
    """True for a file named ``*.gguf`` or one starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as fh:
        return fh.read(4) == MAGIC


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header and tensor table (no tensor data is read yet)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    p = Path(path).absolute()
    if not p.is_file():
        raise ModelImportError(f"{p}: no such GGUF file")
    with open(p, "rb") as fh:
        if p.stat().st_size < 24:
            raise ModelImportError(f"{p}: truncated: {p.stat().st_size} bytes is no GGUF file")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(p, buf)
    magic = bytes(cur.take(4))
    if magic != MAGIC:
        raise ModelImportError(f"{p}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
    version = cur.scalar(4)
    if version not in (2, 3):
        big = version >= 1 << 16  # a big-endian file's version reads byte-swapped here
        raise ModelImportError(f"{p}: " + ("a big-endian GGUF file; needle reads little-endian ones" if big
                               else f"GGUF version {version}; needle reads versions 2 and 3"))  # fmt: skip
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(4))
    records = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar(10) for _ in range(cur.scalar(4)))
        records.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = {}
    for name, dims, code, offset in records:
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise ModelImportError(f"{p}: tensor {name} has unknown ggml type {code}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        info = TensorInfo(name, dims, qtype.name, data_start + offset, count // block * size)
        if info.start + info.nbytes > len(buf):
            raise ModelImportError(
                f"{p}: truncated: tensor {name} ends at byte {info.start + info.nbytes}, the file has {len(buf)}"
            )
        tensors[name] = info
    return GGUFFile(p, version, metadata, tensors, buf)
