"""Streaming, atomic safetensors writing: the one way this pack writes a checkpoint.

The destination is written tensor by tensor after a header planned from names, dtypes and shapes, into a hidden
temporary file beside it (never listed by ComfyUI) that is fsynced and renamed over the destination only once
complete. Any failure (a refusal, an exception, a full disk, an interrupt) removes the temporary file: no partial
checkpoint is ever left where ComfyUI would list it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import struct
from typing import Callable, Iterable, Mapping, Sequence

import torch

Progress = Callable[[int, int, str], None]

ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
DTYPE_NAMES = {getattr(torch, attr): name for attr, name in (
    ("float64", "F64"), ("int64", "I64"), ("uint64", "U64"), ("complex64", "C64"), ("float32", "F32"),
    ("int32", "I32"), ("uint32", "U32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int16", "I16"),
    ("uint16", "U16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"), ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"), ("float8_e8m0fnu", "F8_E8M0")) if hasattr(torch, attr)}  # older torch lacks some


class CheckpointRefused(ValueError):
    """The request cannot be carried out as asked; nothing was written."""


# ---- streaming safetensors writer --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file to write: its header entry, and how to make its data when its turn comes."""
    name: str
    dtype: str  # safetensors dtype name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _write_bytes(handle, data) -> None:
    """Every byte of a written file goes through here."""
    handle.write(data)


def _tensor_bytes(tensor: torch.Tensor, planned: PlannedTensor) -> memoryview:
    made = (DTYPE_NAMES.get(tensor.dtype), tuple(tensor.shape))
    if made != (planned.dtype, planned.shape):
        raise RuntimeError(f"{planned.name}: made {made[0]} {list(made[1])}, the header says "
                           f"{planned.dtype} {list(planned.shape)}")
    return memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _header_bytes(tensors: Sequence[PlannedTensor], metadata: Mapping[str, str]) -> bytes:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors' own writer keeps it
    return struct.pack("<Q", len(raw)) + raw


def check_metadata(metadata: Mapping[str, str]) -> None:
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise CheckpointRefused(f"safetensors metadata maps str to str; not so for {bad[:3]}")


def _check_destination(dest: str, overwrite: bool) -> str:
    folder = os.path.dirname(dest)
    if not os.path.isdir(folder):
        raise CheckpointRefused(f"destination folder {folder} does not exist")
    if not dest.lower().endswith((".safetensors", ".sft")):
        raise CheckpointRefused(f"{dest}: ComfyUI reads a checkpoint as safetensors only when its name ends with "
                                ".safetensors or .sft")
    if os.path.exists(dest) and not overwrite:
        raise CheckpointRefused(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
    return folder


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_folder(folder: str) -> None:
    """Makes the rename itself durable (POSIX; Windows cannot open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_safetensors(dest_path, tensors: Sequence[PlannedTensor], metadata: Mapping[str, str] | None = None, *,
                      progress: Progress | None = None, overwrite: bool = False) -> int:
    """Write ``tensors`` in this order as a safetensors file at ``dest_path`` atomically; returns its size.

    Each tensor's ``make()`` is called when its turn comes, so only one tensor's data is held at a time. Refuses
    (:class:`CheckpointRefused`) an existing destination unless ``overwrite``, and a folder without room for the
    whole file. ``progress(done_bytes, total_bytes, name)`` is called after each tensor."""
    dest = os.path.abspath(os.fspath(dest_path))
    metadata = dict(metadata or {})
    check_metadata(metadata)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise CheckpointRefused("two tensors of the planned file have the same name")
    folder = _check_destination(dest, overwrite)
    header = _header_bytes(tensors, metadata)
    data_bytes = sum(t.nbytes for t in tensors)
    file_bytes = len(header) + data_bytes
    free = shutil.disk_usage(folder).free
    if free < file_bytes:  # an overwritten file's space only comes back after the rename
        raise CheckpointRefused(f"not enough free disk space in {folder}: the checkpoint needs "
                                f"{file_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free")
    # Hidden and not named *.safetensors, so ComfyUI never lists a file being written; O_EXCL and the umask-
    # honouring mode of a normal file (mkstemp would make it readable by its owner only).
    tmp = os.path.join(folder, f".{os.path.basename(dest)}.{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_bytes(handle, header)
            done = 0
            for planned in tensors:
                _write_bytes(handle, _tensor_bytes(planned.make(), planned))
                done += planned.nbytes
                if progress is not None:
                    progress(done, data_bytes, planned.name)
            handle.flush()
            os.fsync(handle.fileno())
        if os.path.exists(dest) and not overwrite:  # appeared while we wrote
            raise CheckpointRefused(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
        os.replace(tmp, dest)
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_folder(folder)
    return file_bytes


def file_order(single: Iterable[PlannedTensor], groups: Sequence[Sequence[PlannedTensor]]) -> list[PlannedTensor]:
    """8- and 4-byte tensors, then the groups, then 2- and 1-byte tensors, by name within each.

    Every tensor then starts at a multiple of its element size, as safetensors' own writer keeps them (ComfyUI's
    mmap loader views the bytes in place); a group (one converted layer: fp32 scalars, then bytes, a multiple of
    4 in all) is written in one piece, so one layer's quantization is held at a time."""
    by_size = sorted(single, key=lambda t: (-ITEMSIZE[t.dtype], t.name))
    wide = [t for t in by_size if ITEMSIZE[t.dtype] >= 4]
    narrow = [t for t in by_size if ITEMSIZE[t.dtype] < 4]
    return wide + [t for group in groups for t in group] + narrow
