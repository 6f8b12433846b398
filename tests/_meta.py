"""GGUF metadata for tokenizer tests, as the dict Tokenizer.from_metadata takes (strings as str,
string arrays as list[str], numeric arrays as numpy arrays).

`read_metadata` is a small key/value-only reader (the tensor data is never touched), because the
`gguf` package's GGUFReader indexes every array element and takes tens of seconds on a 262k-token
vocabulary. `read_metadata_gguf` uses GGUFReader; a test checks that both agree."""
import functools
import struct

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
       11: "<i8", 12: "<f8"}


@functools.lru_cache(maxsize=8)
def read_metadata(path) -> dict:
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        # metadata sits at the start of the file; grow the window until it is all in
        size = 1 << 24
        while True:
            f.seek(0)
            buf = f.read(size)
            try:
                return _parse(buf, n_kv)
            except (struct.error, IndexError):
                if len(buf) < size:
                    raise
                size *= 2


def _parse(buf: bytes, n_kv: int) -> dict:
    mv = memoryview(buf)
    pos = 24

    def string(p):
        (n,) = struct.unpack_from("<Q", buf, p)
        if p + 8 + n > len(buf):
            raise IndexError
        return bytes(mv[p + 8:p + 8 + n]).decode("utf-8"), p + 8 + n

    meta = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype == 8:
            value, pos = string(pos)
        elif vtype == 9:
            etype, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype == 8:
                value = []
                for _ in range(n):
                    s, pos = string(pos)
                    value.append(s)
            else:
                dt = np.dtype(_NP[etype])
                if pos + n * dt.itemsize > len(buf):
                    raise IndexError
                value = np.frombuffer(buf, dtype=dt, count=n, offset=pos).copy()
                pos += n * dt.itemsize
        else:
            fmt = _SCALAR[vtype]
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
        meta[key] = value
    return meta


def read_metadata_gguf(path) -> dict:
    """The same dict through the gguf package's GGUFReader (slow on big vocabularies)."""
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    meta = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if key.startswith("GGUF.") or not field.types:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
            value = np.asarray(value)
        meta[key] = value
    return meta
