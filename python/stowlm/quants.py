"""GGUF tensor encodings: decode raw GGUF blocks to float32 and encode float32 into blocks.

Results are bit-identical to the ``gguf`` package's ``gguf.quants.dequantize`` / ``quantize``.
A type may be given as its GGUF name ("Q4_K", case-insensitive), its numeric id, or anything
with ``int()`` or a ``name`` attribute (e.g. ``gguf.GGMLQuantizationType.Q4_K``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from ._core import quants as _q

__all__ = ["TypeInfo", "type_info", "dequantize", "quantize"]


class TypeInfo(NamedTuple):
    name: str
    id: int
    block_elems: int  # elements per block
    block_bytes: int  # bytes per block
    decodable: bool  # dequantize() supports it
    quantizable: bool  # quantize() supports it

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of n elements (n must be a whole number of blocks)."""
        _check_row(self, n)
        return n // self.block_elems * self.block_bytes


def _type_id(qtype: Any) -> int:
    if isinstance(qtype, str):
        return int(_q.type_id(qtype.strip().upper()))
    if isinstance(qtype, (bool, float)):
        raise ValueError(f"tensor type must be a name or an integer id, got {qtype!r}")
    try:
        return int(qtype.__index__())
    except (AttributeError, TypeError):
        pass
    try:
        return int(qtype)
    except (TypeError, ValueError):
        pass
    name = getattr(qtype, "name", None)
    if isinstance(name, str):
        return int(_q.type_id(name.strip().upper()))
    raise ValueError(f"tensor type must be a name or an integer id, got {qtype!r}")


def type_info(qtype: Any) -> TypeInfo:
    """(name, id, block_elems, block_bytes, decodable, quantizable) of a GGUF tensor type."""
    return TypeInfo(*_q.type_info(_type_id(qtype)))


def _check_row(info: TypeInfo, n: int) -> None:
    if n % info.block_elems != 0:
        raise ValueError(
            f"last dimension {n} is not a multiple of the {info.name} block size {info.block_elems}"
        )


def _as_bytes(raw: Any) -> np.ndarray:
    if isinstance(raw, np.ndarray):
        arr = np.ascontiguousarray(raw)
        return arr.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
    except TypeError as e:
        raise ValueError(f"raw data must be bytes, a numpy array or a buffer, got {type(raw).__name__}") from e


def dequantize(raw: Any, qtype: Any, shape: int | Sequence[int]) -> np.ndarray:
    """Decodes raw GGUF tensor data of type qtype into a float32 array of the given logical
    shape (last dimension = row length, a whole number of blocks)."""
    info = type_info(qtype)
    if not info.decodable:
        raise ValueError(f"tensor type {info.name} (id {info.id}) is not supported by stowlm")
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    if shape:
        _check_row(info, shape[-1])
    n = int(np.prod(shape, dtype=np.int64))
    if n % info.block_elems != 0:  # a 0-d shape holds one element
        raise ValueError(f"{n} elements are not a multiple of the {info.name} block size {info.block_elems}")
    src = _as_bytes(raw)
    expected = n // info.block_elems * info.block_bytes
    if src.size != expected:
        raise ValueError(
            f"{info.name} data for shape {shape} must be {expected} bytes, got {src.size} bytes"
        )
    out = np.empty(shape, dtype=np.float32)
    if n:
        _q.dequantize_into(src, info.id, out.reshape(-1))
    return out


def quantize(array: Any, qtype: Any) -> np.ndarray:
    """Encodes a float array as GGUF blocks of type qtype: a uint8 array of shape
    (..., row_bytes) holding the raw GGUF bytes of each row."""
    info = type_info(qtype)
    if not info.quantizable:
        raise ValueError(f"quantizing to {info.name} (id {info.id}) is not implemented")
    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("cannot quantize a 0-d array: it has no rows")
    _check_row(info, x.shape[-1])
    out = np.empty((*x.shape[:-1], x.shape[-1] // info.block_elems * info.block_bytes), dtype=np.uint8)
    if x.size:
        _q.quantize_into(x.reshape(-1), info.id, out.reshape(-1))
    return out
