"""Safetensors files read by slices and written tensor by tensor.

* ``read_header(path)``: the JSON header (names, dtypes, shapes) without reading any tensor data, so a whole
  checkpoint is validated before anything is converted.
* ``SliceReader``: rows / columns of a tensor, reading only those rows from the file.
* ``StreamingWriter``: a file whose header (every name, dtype and shape) is written first; each tensor's bytes
  then go to their offset as soon as the tensor exists, so a converter holds one tensor at a time instead of
  a whole file's worth (``safetensors.torch.save_file`` needs them all at once).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConvertError
from .mapping import Range

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> Dict[str, Dict]:
    """The tensors of a safetensors file, ``name -> {"dtype", "shape", "data_offsets"}`` (``__metadata__`` dropped)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


class SliceReader:
    """``read(file, name, rows, cols)``: that block of a tensor, read with plain positioned reads.

    Only the rows asked for are read (a column range reads its rows, then keeps the columns).  No memory map:
    a mapped checkpoint's pages would count towards the process's memory as they are touched, whole files of
    them, while a read holds just the block."""

    def __init__(self):
        self._files: Dict[str, Tuple[object, int, Dict[str, Dict]]] = {}

    def _file(self, path: str):
        if path not in self._files:
            f = open(path, "rb")
            (size,) = struct.unpack("<Q", f.read(8))
            self._files[path] = (f, 8 + size, json.loads(f.read(size)))
        return self._files[path]

    def read(self, path: str, name: str, rows: Optional[Range] = None, cols: Optional[Range] = None) -> torch.Tensor:
        f, data_start, header = self._file(path)
        entry = header[name]
        dtype, shape = TORCH_DTYPES[entry["dtype"]], entry["shape"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_bytes = itemsize * int(torch.Size(shape[1:]).numel())
        a, b = rows if rows is not None else (0, shape[0])
        f.seek(data_start + entry["data_offsets"][0] + a * row_bytes)
        buf = bytearray((b - a) * row_bytes)
        f.readinto(buf)
        block = torch.frombuffer(buf, dtype=dtype).reshape([b - a] + list(shape[1:])) if buf else \
            torch.empty([0] + list(shape[1:]), dtype=dtype)
        if cols is not None:
            block = block[:, cols[0]:cols[1]].clone()  # frees the other columns with ``buf``
        return block

    def close(self) -> None:
        for f, _, _ in self._files.values():
            f.close()
        self._files.clear()


class StreamingWriter:
    """A safetensors file written tensor by tensor (see the module docstring); ``close`` checks every tensor came."""

    def __init__(self, path: str, tensors: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None):
        header: Dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        self._slots: Dict[str, Tuple[int, int, torch.dtype, Tuple[int, ...]]] = {}
        for name, dtype, shape in tensors:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._slots[name] = (offset, nbytes, dtype, tuple(shape))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.path = path
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._data_start = 8 + len(text)
        self._file.truncate(self._data_start + offset)
        self._written: set = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, nbytes, dtype, shape = self._slots[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ConvertError(f"{self.path}: tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                               f"{dtype} {shape} (a converter bug)")
        self._file.seek(self._data_start + offset)
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no extra copy
        self._written.add(name)

    def close(self) -> None:
        self._file.close()
        missing = [n for n in self._slots if n not in self._written]
        if missing:
            raise ConvertError(f"{self.path}: tensors never written: {', '.join(missing[:3])} (a converter bug)")


def hf_weight_files(hf_dir: str) -> Dict[str, str]:
    """``tensor name -> file path`` of a Hugging Face checkpoint; every listed shard must exist."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        out = {}
        for name, file in weight_map.items():
            path = os.path.join(hf_dir, file)
            if not os.path.isfile(path):
                raise ConvertError(f"{path}: missing shard (model.safetensors.index.json lists tensor {name} in it); "
                                   "download the complete checkpoint")
            out[name] = path
        return out
    single = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise ConvertError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json; save the model with "
                           "safe_serialization=True")
    return {name: single for name in read_header(single)}


def tensor_table(files: Dict[str, str]) -> Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """``name -> (path, dtype, shape)`` from the headers of ``files`` (``name -> path``); nothing else is read."""
    headers: Dict[str, Dict] = {}
    out = {}
    for name, path in files.items():
        if path not in headers:
            headers[path] = read_header(path)
        entry = headers[path].get(name)
        if entry is None:
            raise ConvertError(f"{path}: tensor {name} is listed in the index but not in the file")
        if entry["dtype"] not in TORCH_DTYPES:
            raise ConvertError(f"{path}: tensor {name} has dtype {entry['dtype']}, which is not supported")
        out[name] = (path, TORCH_DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return out


def files_by_path(table: Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for name, (path, _, _) in table.items():
        out.setdefault(path, []).append(name)
    return out
