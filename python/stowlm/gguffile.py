"""Reading GGUF files: metadata, the tensor table, and zero-copy tensor bytes.

Values come back as Python values: integers as int, floats as float, BOOL as bool, STRING as
str, numeric arrays as 1-D numpy arrays (copies) of the stored dtype, and string
arrays as a list of str. GGUF strings should be UTF-8; bytes that are not are decoded with
``errors="surrogateescape"``, so ``s.encode("utf-8", "surrogateescape")`` gives back the exact
bytes of the file.

Split models (``NAME-00001-of-0000N.gguf``) open as one from any part's path: the tensors of all
parts, the metadata of the first.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from . import _core


class TensorInfo(NamedTuple):
    name: str
    type: str  # GGUF type name, e.g. "Q4_K"
    shape: tuple  # numpy order: reversed GGUF ne, so shape[-1] is the row length
    nbytes: int
    offset: int  # absolute byte offset of the data in its (split) file


class GGUFFile:
    """An open GGUF model; the file stays mapped while this object or any tensor view lives."""

    def __init__(self, path: str | os.PathLike):
        self._path = os.fspath(path)
        self._f = _core.gguf.GGUFFile.open(self._path)
        self._metadata = None
        self._tensors = None
        self._split_of = None

    def _native(self):
        if self._f is None:
            raise ValueError(f"{self._path}: the GGUF file is closed")
        return self._f

    @property
    def path(self) -> str:
        return self._path

    @property
    def version(self) -> int:
        return self._native().version

    @property
    def n_splits(self) -> int:
        return self._native().n_splits

    @property
    def split_paths(self) -> list[str]:
        """The path of each part, first to last (one entry for a single-file model)."""
        return self._native().split_paths

    @property
    def metadata(self) -> dict:
        if self._metadata is None:
            self._metadata = self._native().metadata()
        return self._metadata

    @property
    def metadata_types(self) -> dict:
        """{key: GGUF value type name}, arrays as e.g. "ARRAY[FLOAT32]"."""
        return self._native().metadata_types()

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def _load_tensors(self):
        if self._tensors is None:
            rows = self._native().tensors()
            self._tensors = [TensorInfo(*r[:5]) for r in rows]
            self._split_of = {r[0]: r[5] for r in rows}

    @property
    def tensors(self) -> list[TensorInfo]:
        self._load_tensors()
        return self._tensors

    def tensor_split(self, name: str) -> int:
        """Index of the split part holding tensor `name` (0 for single-file models)."""
        self._load_tensors()
        if name not in self._split_of:
            raise ValueError(f"{self._path}: tensor '{name}': not in the model")
        return self._split_of[name]

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view of the mapping (no copy)."""
        return self._native().tensor_data(name)

    def close(self) -> None:
        """Drops this object's hold on the mapping; views already taken stay valid."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._f is None else f"{len(self.tensors)} tensors"
        return f"GGUFFile({self._path!r}, {state})"


def open(path: str | os.PathLike) -> GGUFFile:  # noqa: A001 - mirrors the builtin on purpose
    return GGUFFile(path)
