"""CPU operators on numpy arrays, thin over stowlm._core.ops / stowlm._core.cpu.

Each group of ops adds its wrappers below its own section header; native functions that need
no wrapper are re-exported as they are.
"""
from __future__ import annotations

import numpy as np

from . import _core

_ops = _core.ops
_cpu = _core.cpu


def _qtype_id(qtype) -> int:
    """GGUF type id from an id, a name ('Q4_K'), or a gguf.GGMLQuantizationType."""
    table = _core.qtypes()  # {name: (id, block_elems, block_bytes)} of the supported types
    if isinstance(qtype, str):
        key = qtype.upper()
        for name, info in table.items():
            if name.upper() == key:
                return info[0]
        raise ValueError(f"unknown weight type {qtype!r}; known: {sorted(table)}")
    try:
        return int(qtype)
    except (TypeError, ValueError):
        raise ValueError(f"weight type must be a GGUF type id or name, got {qtype!r}") from None


# ---- CPU features / kernel path ------------------------------------------------------------

def cpu_info() -> dict:
    """{'flags': usable CPU features, 'best': best kernel path, 'active': path in use,
    'supported': every path this CPU/OS can run}."""
    return {"flags": list(_cpu.features()), "best": _cpu.best_isa(), "active": _cpu.active_isa(),
            "supported": list(_cpu.supported_isas())}


def set_isa(name: str) -> None:
    """Force the matmul kernel path: 'scalar', 'avx2', 'avx512' or 'amx' (RuntimeError if the
    CPU/OS cannot run it, ValueError for an unknown name)."""
    _cpu.set_isa(name)


# ---- matmul --------------------------------------------------------------------------------

def matmul(W_raw, qtype, x, *, rows: int | None = None, cols: int | None = None, threads: int = 0,
           rows16: bool = False, batched: bool = False):
    """y = W x for GGUF weight bytes W_raw of type `qtype` (id or name).

    W_raw: uint8 (rows, row_bytes), or flat with rows= and cols= given.
    x: float32 (n_tok, cols) -> returns (n_tok, rows); or (cols,) -> returns (rows,).
    rows16: W_raw is in the CPU's 16-row groups (repack_rows16's bytes).
    batched: the batched kernels whatever the number of tokens (as a pass forced onto them).
    """
    table = {v[0]: (k, v[1], v[2]) for k, v in _core.qtypes().items()}
    tid = _qtype_id(qtype)
    if tid not in table:
        raise ValueError(f"unknown or unsupported weight type id {tid}")
    name, belems, bbytes = table[tid]
    W = np.ascontiguousarray(W_raw)
    if W.dtype != np.uint8:
        raise ValueError(f"W_raw must be uint8 bytes, got dtype {W.dtype}")
    if W.ndim == 2 and rows is None and cols is None:
        rows = W.shape[0]
        if W.shape[1] % bbytes:
            raise ValueError(f"W_raw row of {W.shape[1]} bytes is not a whole number of {name} blocks "
                             f"({bbytes} bytes)")
        cols = W.shape[1] // bbytes * belems
    elif rows is None or cols is None:
        raise ValueError("give rows= and cols= for a W_raw that is not (rows, row_bytes)")
    xa = np.asarray(x)
    if xa.dtype != np.float32:
        raise ValueError(f"x must be float32, got dtype {xa.dtype}")
    if xa.ndim not in (1, 2):
        raise ValueError(f"x must be (cols,) or (n_tok, cols), got shape {xa.shape}")
    vec = xa.ndim == 1
    x2 = np.ascontiguousarray(xa.reshape(1, -1) if vec else xa)
    y = _ops.matmul_raw(W.reshape(-1), tid, int(rows), int(cols), x2, int(threads), bool(rows16), bool(batched))
    return y[0] if vec else y


def repack_rows16(W_raw, qtype, rows: int, cols: int):
    """GGUF weight bytes (Q4_0, Q5_0 or Q8_0, rows a multiple of 16) in the groups of 16
    interleaved rows that the CPU keeps such weights in at load (flat uint8, the same size)."""
    W = np.ascontiguousarray(W_raw).view(np.uint8).reshape(-1)
    return _ops.repack_rows16_raw(W, _qtype_id(qtype), int(rows), int(cols))


def unrepack_row16(W16, qtype, rows: int, cols: int, r: int):
    """Row r of repack_rows16's bytes in the GGUF layout again."""
    W = np.ascontiguousarray(W16).view(np.uint8).reshape(-1)
    return _ops.unrepack_row16_raw(W, _qtype_id(qtype), int(rows), int(cols), int(r))


# ---- mul_mat_id (mixture-of-experts products) ----------------------------------------------

def mul_mat_id(W_raw, qtype, n_expert: int, rows: int, cols: int, x, ids, *, threads: int = 0, rows16: bool = False):
    """Expert products: y[t, j] = W[ids[t, j]] @ x[t, j] (or x[t] for every j when x is 2-d),
    W_raw holding n_expert stacked (rows, cols) matrices of GGUF type `qtype` (id or name), each
    repacked by repack_rows16 where rows16.
    x: float32 (n_tok, cols) or (n_tok, k, cols); ids: int (n_tok, k). Returns (n_tok, k, rows)."""
    ids = np.ascontiguousarray(np.asarray(ids), dtype=np.int32)
    if ids.ndim != 2:
        raise ValueError(f"mul_mat_id: ids must be (n_tok, k), got shape {ids.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 2:
        x = x[:, None, :]
    if x.ndim != 3:
        raise ValueError(f"mul_mat_id: x must be (n_tok, cols) or (n_tok, k, cols), got shape {x.shape}")
    w = np.ascontiguousarray(np.asarray(W_raw)).view(np.uint8).reshape(-1)
    return _ops.mul_mat_id_raw(w, _qtype_id(qtype), int(n_expert), int(rows), int(cols), x, ids, int(threads),
                               bool(rows16))
