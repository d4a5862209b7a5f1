"""Streaming, atomic safetensors writing: the one way this pack writes a checkpoint.

The destination is written tensor by tensor after a header planned from names, dtypes and shapes, into a hidden
temporary file beside it (never listed by ComfyUI) that is fsynced and renamed over the destination only once
complete. Any failure (a refusal, an exception, a full disk, an interrupt that raises: Ctrl-C, and SIGTERM in the
converter, which turns it into an exception) removes the temporary file: no partial checkpoint is ever left where
ComfyUI would list it.

A process killed outright (SIGKILL, a power cut) cannot clean up. Temporary files are therefore named
``.<dest name>.<writer pid>.<random>.partial`` (and an overwritten file kept aside during a two-file replacement
``...old``): every write into a folder first removes the leftovers there whose writer is no longer running (a kept-
aside file goes back to its name if nothing took that name since), and logs the ones a running process may still be
writing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
from typing import Callable, Iterable, Mapping, Sequence

import torch

Progress = Callable[[int, int, str], None]
log = logging.getLogger("h3_fused_nvfp4")
# .<name>.<pid>.<8 hex>.partial (being written) / .old (an overwritten file kept aside until its replacement is
# in place)
LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(?P<kind>partial|old)$")

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


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (PermissionError), or no way to tell: assume it runs
        return True
    return True


def clean_leftovers(folder: str) -> list[str]:
    """Remove the temporary files of writers that are no longer running from ``folder`` (see the module
    docstring); a kept-aside ``.old`` file goes back to its name when that name is free. Returns the leftovers
    left in place because their writer still runs (they are logged)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    busy = []
    for entry in names:
        match = LEFTOVER_RE.match(entry)
        if match is None:
            continue
        path = os.path.join(folder, entry)
        if _pid_alive(int(match["pid"])):
            if int(match["pid"]) != os.getpid():
                busy.append(path)
            continue
        try:
            if match["kind"] == "old" and not os.path.lexists(os.path.join(folder, match["name"])):
                os.replace(path, os.path.join(folder, match["name"]))
                log.warning("H3 fused NVFP4: restored %s, left aside by an interrupted write (process %s)",
                            match["name"], match["pid"])
            else:
                os.unlink(path)
                log.warning("H3 fused NVFP4: removed %s, left by an interrupted write (process %s)", path,
                            match["pid"])
        except OSError as exc:
            log.warning("H3 fused NVFP4: could not remove %s, left by an interrupted write: %s", path, exc)
    for path in busy:
        log.warning("H3 fused NVFP4: %s is a temporary file of process %s, which still runs: left in place "
                    "(delete it if no write of that process is in progress)", path,
                    LEFTOVER_RE.match(os.path.basename(path))["pid"])
    return busy


def temporary_name(dest: str, kind: str = "partial") -> str:
    """A hidden name beside ``dest`` that ComfyUI never lists, carrying this process's id (module docstring)."""
    folder, name = os.path.split(dest)
    return os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}")


def write_safetensors(dest_path, tensors: Sequence[PlannedTensor], metadata: Mapping[str, str] | None = None, *,
                      progress: Progress | None = None, overwrite: bool = False) -> int:
    """Write ``tensors`` in this order as a safetensors file at ``dest_path`` atomically; returns its size.

    Each tensor's ``make()`` is called when its turn comes, so only one tensor's data is held at a time. Refuses
    (:class:`CheckpointRefused`) an existing destination unless ``overwrite``, and a folder without room for the
    whole file. ``progress(done_bytes, total_bytes, name)`` is called after each tensor."""
    dest = os.path.abspath(os.fspath(dest_path))
    tmp, size = write_safetensors_partial(dest, tensors, metadata, progress=progress, overwrite=overwrite)
    try:
        if os.path.exists(dest) and not overwrite:  # appeared while we wrote
            raise CheckpointRefused(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
        os.replace(tmp, dest)
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_folder(os.path.dirname(dest))
    return size


def write_safetensors_partial(dest_path, tensors: Sequence[PlannedTensor], metadata: Mapping[str, str] | None = None,
                              *, progress: Progress | None = None, overwrite: bool = False) -> tuple[str, int]:
    """:func:`write_safetensors` up to the rename: the complete, fsynced file under a temporary name beside
    ``dest_path``, and its size. The caller renames it into place or removes it."""
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
    clean_leftovers(folder)
    # Hidden and not named *.safetensors, so ComfyUI never lists a file being written; O_EXCL and the umask-
    # honouring mode of a normal file (mkstemp would make it readable by its owner only).
    tmp = temporary_name(dest)
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
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp, file_bytes


def write_bytes_partial(dest_path, data: bytes) -> str:
    """``data`` in a complete, fsynced temporary file beside ``dest_path`` (named as :func:`temporary_name`);
    the caller renames it into place or removes it."""
    tmp = temporary_name(os.path.abspath(os.fspath(dest_path)))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_bytes(handle, data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def replace_together(moves: Sequence[tuple[str, str]], overwrite: bool) -> None:
    """Rename each complete temporary file onto its destination, all or none: existing destinations (only with
    ``overwrite``) are kept aside under hidden names until every new file is in place, and put back if any rename
    fails; the temporary files are removed then. Between the renames a destination may briefly be missing, never
    a mix of old and new once this returns or raises."""
    aside: list[tuple[str, str]] = []  # (kept-aside name, destination)
    placed: list[str] = []
    try:
        for _, dest in moves:
            if os.path.lexists(dest):
                if not overwrite:
                    raise CheckpointRefused(f"{dest} already exists (enable overwrite to replace it)")
                backup = temporary_name(dest, "old")
                os.replace(dest, backup)
                aside.append((backup, dest))
        for tmp, dest in moves:
            os.replace(tmp, dest)
            placed.append(dest)
    except BaseException:
        for dest in placed:
            _remove_quietly(dest)
        for backup, dest in reversed(aside):
            try:
                os.replace(backup, dest)
            except OSError as exc:  # the next write into this folder puts it back (clean_leftovers)
                log.warning("H3 fused NVFP4: could not put %s back from %s: %s", dest, backup, exc)
        for tmp, _ in moves:
            _remove_quietly(tmp)
        raise
    for backup, _ in aside:
        _remove_quietly(backup)
    if moves:
        _fsync_folder(os.path.dirname(moves[0][1]))


def file_order(single: Iterable[PlannedTensor], groups: Sequence[Sequence[PlannedTensor]]) -> list[PlannedTensor]:
    """8- and 4-byte tensors, then the groups, then 2- and 1-byte tensors, by name within each.

    Every tensor then starts at a multiple of its element size, as safetensors' own writer keeps them (ComfyUI's
    mmap loader views the bytes in place); a group (one converted layer: fp32 scalars, then bytes, a multiple of
    4 in all) is written in one piece, so one layer's quantization is held at a time."""
    by_size = sorted(single, key=lambda t: (-ITEMSIZE[t.dtype], t.name))
    wide = [t for t in by_size if ITEMSIZE[t.dtype] >= 4]
    narrow = [t for t in by_size if ITEMSIZE[t.dtype] < 4]
    return wide + [t for group in groups for t in group] + narrow
