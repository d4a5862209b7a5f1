"""Streaming, atomic safetensors writing: the one way this pack writes a checkpoint.

A :class:`StagedWrite` writes each file (a safetensors file tensor by tensor after a header planned from names,
dtypes and shapes, or plain bytes) under a hidden temporary name beside its destination (never listed by ComfyUI),
fsynced, and moves the files into place together only once all are complete (:meth:`StagedWrite.commit`). Any
failure (a refusal, an exception, a full disk, an interrupt that raises: Ctrl-C, and the stop signals the converter
turns into exceptions) removes the temporary files: no partial checkpoint is ever left where ComfyUI would list it.

A destination's name always holds a complete file: an overwritten destination is replaced by one rename, never
moved aside first. Moves run in the order the files were staged and the last one completes the write: the earlier
destinations (the small statistics file of Save Calibrated) are kept aside as a hard link (or a copy) until it is
in place, and put back if anything fails, so a pair is replaced all or none.

A process killed outright (SIGKILL, a power cut) cannot clean up. Each writer therefore holds an exclusive lock on
a hidden lock file ``.h3-fused-nvfp4.<token>.lock`` in the folder for its whole life; its temporary files carry the
same random token (``.<name>.<token>.partial``, a kept-aside file ``...old``). The lock ends with its process
however that ends and is seen by every process sharing the folder (other containers on a shared volume included:
one kernel; a network file system through its lock manager), unlike a process id, which means nothing in another
PID namespace and is reused by a restarted container. Every write into a folder first removes the files of writers
whose lock is free, after putting back the kept-aside files of a move they did not finish (their lock file holds
the list of moves), and logs the files of writers still running.
"""

from __future__ import annotations

import dataclasses
import errno
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

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

Progress = Callable[[int, int, str], None]
log = logging.getLogger("h3_fused_nvfp4")
LOCK_NAME = "h3-fused-nvfp4"
# .<name, shortened>.<16 hex>.partial (being written) / .old (a destination kept aside until the write completes) /
# .h3-fused-nvfp4.<16 hex>.lock (held by the writer while it runs)
LEFTOVER_RE = re.compile(r"^\.(?P<name>.*)\.(?P<token>[0-9a-f]{16})\.(?P<kind>partial|old|lock)$")
SHORT_NAME_BYTES = 120  # of a destination's name in its temporary names: any name the folder takes fits
DEFAULT_NAME_MAX = 255

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


def name_max(folder: str) -> int:
    """The longest file name (in bytes) ``folder``'s file system takes."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or no answer
        return DEFAULT_NAME_MAX


def check_destination(dest: str, overwrite: bool) -> str:
    """The folder of ``dest`` (an absolute path), after the checks a destination passes before anything is written
    (:class:`CheckpointRefused` otherwise): its folder exists, its name fits the file system, it is no folder, and
    it exists only with ``overwrite`` (a symbolic link counts, even one whose target is missing)."""
    folder, name = os.path.split(dest)
    if not os.path.isdir(folder):
        raise CheckpointRefused(f"destination folder {folder} does not exist")
    limit = name_max(folder)
    if len(os.fsencode(name)) > limit:
        raise CheckpointRefused(f"{name!r} is {len(os.fsencode(name))} bytes long, longer than the {limit} bytes a "
                                f"file name in {folder} can have")
    if os.path.isdir(dest):
        raise CheckpointRefused(f"{dest} is a folder; give the name of a file to write")
    if os.path.lexists(dest) and not overwrite:
        raise CheckpointRefused(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
    return folder


def _check_checkpoint_name(dest: str) -> None:
    if not dest.lower().endswith((".safetensors", ".sft")):
        raise CheckpointRefused(f"{dest}: ComfyUI reads a checkpoint as safetensors only when its name ends with "
                                ".safetensors or .sft")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_folder(folder: str) -> None:
    """Makes the renames themselves durable (POSIX; Windows cannot open a folder)."""
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


def _write_file(path: str, chunks: Iterable) -> None:
    """A new file at ``path`` (fails if the name exists) with the umask-honouring mode of a normal file (mkstemp's
    are owner-only), every chunk written through :func:`_write_bytes`, flushed and fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    with os.fdopen(fd, "wb") as handle:
        for chunk in chunks:
            _write_bytes(handle, chunk)
        handle.flush()
        os.fsync(handle.fileno())


# ---- the writer's lock -------------------------------------------------------------------------------------

def _try_lock(fd: int) -> bool | None:
    """Take the exclusive lock of the open file ``fd`` without waiting: True when taken, False when another open
    file holds it (its writer runs), None where the file system has no locks (whether its writer runs cannot be
    told). The lock ends when the file is closed, or with its process, however that ends."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK):
            return False
        return None
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        opened, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _lock_path(folder: str, token: str) -> str:
    return os.path.join(folder, f".{LOCK_NAME}.{token}.lock")


# ---- staged writes -----------------------------------------------------------------------------------------

class StagedWrite:
    """The files of one write into ``folder``: each is staged complete under a hidden temporary name, then all are
    moved into place together by :meth:`commit`; on exit everything not moved into place is removed. A context
    manager that holds the writer's lock from entry to exit and first removes the leftovers of writers that are
    gone (module docstring)."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(os.fspath(folder))
        self.token = ""
        self._lock_fd: int | None = None
        self._staged: list[tuple[str, str]] = []  # (temporary file, destination), in staging order
        self._created: list[str] = []  # every hidden file this write made

    def __enter__(self) -> "StagedWrite":
        if not os.path.isdir(self.folder):
            raise CheckpointRefused(f"destination folder {self.folder} does not exist")
        self._lock_fd = self._take_lock()
        try:
            clean_leftovers(self.folder, own=self.token)
        except BaseException:
            self._finish()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._finish()
        return False

    def _take_lock(self) -> int:
        for _ in range(8):
            self.token = secrets.token_hex(8)
            path = _lock_path(self.folder, self.token)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            # Between the creation and the lock a cleaner may take the new file's lock and remove it (it looks like
            # a gone writer's); the lock is ours only while the name still holds the file we locked.
            if _try_lock(fd) is not False and _same_file(fd, path):
                return fd
            os.close(fd)
        raise OSError(errno.EBUSY, f"could not take a writer's lock in {self.folder}")

    def _finish(self) -> None:
        """Remove every hidden file of this write still there, then the lock file, then release the lock."""
        for path in self._created:
            if os.path.lexists(path):
                try:
                    os.unlink(path)
                except OSError as exc:
                    log.warning("H3 fused NVFP4: could not remove the temporary file %s: %s", path, exc)
        if self._lock_fd is not None:
            _remove_quietly(_lock_path(self.folder, self.token))
            os.close(self._lock_fd)
            self._lock_fd = None

    def temporary(self, dest: str, kind: str = "partial") -> str:
        """A new hidden name beside ``dest`` that ComfyUI never lists: the start of dest's name (any name the
        folder takes leaves room), a number, this write's token."""
        short = os.fsencode(os.path.basename(dest))[:SHORT_NAME_BYTES].decode("utf-8", "ignore")
        path = os.path.join(self.folder, f".{short}.{len(self._created)}.{self.token}.{kind}")
        self._created.append(path)
        return path

    def _destination(self, dest, overwrite: bool) -> str:
        dest = os.path.abspath(os.fspath(dest))
        if os.path.dirname(dest) != self.folder:
            raise ValueError(f"{dest} is not in {self.folder}: a staged write stays in one folder")
        check_destination(dest, overwrite)
        return dest

    def stage_safetensors(self, dest, tensors: Sequence[PlannedTensor], metadata: Mapping[str, str] | None = None,
                          *, progress: Progress | None = None, overwrite: bool = False) -> int:
        """Write ``tensors`` in this order as a complete safetensors file for ``dest``; returns its size.

        Each tensor's ``make()`` is called when its turn comes, so only one tensor's data is held at a time.
        ``progress(done_bytes, total_bytes, name)`` is called after each tensor. Refuses (:class:`CheckpointRefused`)
        what :func:`check_destination` refuses, a name ComfyUI does not read as a checkpoint, and a folder without
        room for the whole file."""
        dest = self._destination(dest, overwrite)
        _check_checkpoint_name(dest)
        metadata = dict(metadata or {})
        check_metadata(metadata)
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise CheckpointRefused("two tensors of the planned file have the same name")
        header = _header_bytes(tensors, metadata)
        data_bytes = sum(t.nbytes for t in tensors)
        file_bytes = len(header) + data_bytes
        free = shutil.disk_usage(self.folder).free
        if free < file_bytes:  # an overwritten file's space only comes back after the rename
            raise CheckpointRefused(f"not enough free disk space in {self.folder}: the checkpoint needs "
                                    f"{file_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free")

        def chunks():
            yield header
            done = 0
            for planned in tensors:
                yield _tensor_bytes(planned.make(), planned)
                done += planned.nbytes
                if progress is not None:
                    progress(done, data_bytes, planned.name)

        tmp = self.temporary(dest)
        _write_file(tmp, chunks())
        self._staged.append((tmp, dest))
        return file_bytes

    def stage_bytes(self, dest, data: bytes, *, overwrite: bool = False) -> None:
        """``data`` as the complete file for ``dest``."""
        dest = self._destination(dest, overwrite)
        tmp = self.temporary(dest)
        _write_file(tmp, [data])
        self._staged.append((tmp, dest))

    def commit(self, overwrite: bool) -> None:
        """Move every staged file onto its destination, in staging order, all or none: each destination is replaced
        by one rename (never hidden); those before the last are kept aside (a hard link, else a copy: stage large
        files last) until the last is in place and put back if a move fails. The list of moves goes into the lock
        file first, so a cleaner can put them back if this process dies before the last one."""
        moves = list(self._staged)
        for _, dest in moves:  # a destination may have appeared while the files were written
            check_destination(dest, overwrite)
        aside = [(self._keep_aside(dest) if os.path.lexists(dest) else None, dest) for _, dest in moves[:-1]]
        self._write_journal(moves, aside)
        placed: list[str] = []
        try:
            for tmp, dest in moves:
                os.replace(tmp, dest)
                placed.append(dest)
        except BaseException:
            _put_back(aside, placed)
            raise
        self._staged.clear()
        _fsync_folder(self.folder)

    def _keep_aside(self, dest: str) -> str:
        backup = self.temporary(dest, "old")
        try:
            os.link(dest, backup, follow_symlinks=False)
        except (OSError, NotImplementedError):  # a file system without hard links; Windows links no link itself
            shutil.copy2(dest, backup, follow_symlinks=False)
        return backup

    def _write_journal(self, moves, aside) -> None:
        kept = dict((dest, backup) for backup, dest in aside)
        journal = {"moves": [[os.path.basename(tmp), os.path.basename(dest),
                              os.path.basename(kept[dest]) if kept.get(dest) else None] for tmp, dest in moves]}
        if self._lock_fd is not None and len(moves) > 1:
            os.ftruncate(self._lock_fd, 0)
            os.lseek(self._lock_fd, 0, os.SEEK_SET)
            os.write(self._lock_fd, json.dumps(journal).encode())
            os.fsync(self._lock_fd)


def _put_back(aside: Sequence[tuple[str | None, str]], placed: Sequence[str]) -> None:
    """Undo the moves onto ``placed`` among ``aside``'s destinations: the kept-aside file back, or the new file
    removed where there was none."""
    for backup, dest in aside:
        if dest not in placed:
            continue
        try:
            if backup is not None:
                os.replace(backup, dest)
            else:
                os.unlink(dest)
        except OSError as exc:
            log.warning("H3 fused NVFP4: could not put %s back%s: %s", dest, f" from {backup}" if backup else "", exc)


# ---- leftovers of writers that are gone --------------------------------------------------------------------

def _writer_state(folder: str, token: str) -> tuple[bool | None, int | None]:
    """(True: the writer of ``token`` is gone, False: it runs, None: cannot be told; the lock file's descriptor,
    held locked while the writer's files are removed, or None where it has none)."""
    try:
        fd = os.open(_lock_path(folder, token),
                     os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:  # a writer makes its lock file before its first file and removes it after its last
        return True, None
    except OSError:
        return None, None
    state = _try_lock(fd)
    if state is not True:
        os.close(fd)
        return state, None
    return True, fd


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and not any(sep in name for sep in (os.sep, os.altsep) if sep))


def _journal(fd: int, token: str) -> list | None:
    """The moves a gone writer listed in its lock file: only a file of this user's (another user cannot make this
    process move files), only plain names in the folder, its own temporary files by their token."""
    def own(name) -> bool:
        match = LEFTOVER_RE.match(name) if _plain_name(name) else None
        return match is not None and match["token"] == token

    try:
        if hasattr(os, "geteuid") and os.fstat(fd).st_uid != os.geteuid():
            return None
        data = json.loads(os.read(fd, 1 << 16) or b"null")
        moves = data["moves"] if isinstance(data, dict) else None
        if (isinstance(moves, list) and moves and all(isinstance(m, list) and len(m) == 3 for m in moves)
                and all(own(tmp) and _plain_name(dest) and (backup is None or own(backup))
                        for tmp, dest, backup in moves)):
            return moves
    except (OSError, ValueError, KeyError, RecursionError):
        pass
    return None


def _undo_unfinished_moves(folder: str, moves: list) -> None:
    """A gone writer's moves when the last one did not happen (its temporary file is still there): the earlier
    destinations it replaced get their kept-aside files back (or lose the new file, where there was none)."""
    if not os.path.lexists(os.path.join(folder, moves[-1][0])):
        return
    for tmp, dest, backup in moves[:-1]:
        if os.path.lexists(os.path.join(folder, tmp)):
            continue  # not moved
        dest_path = os.path.join(folder, dest)
        try:
            if backup is not None:
                os.replace(os.path.join(folder, backup), dest_path)
                log.warning("H3 fused NVFP4: put %s back, replaced by a write that did not finish", dest_path)
            else:
                os.unlink(dest_path)
                log.warning("H3 fused NVFP4: removed %s, placed by a write that did not finish", dest_path)
        except OSError as exc:
            log.warning("H3 fused NVFP4: could not undo the unfinished write of %s: %s", dest_path, exc)


def clean_leftovers(folder: str, own: str = "") -> list[str]:
    """Remove from ``folder`` the files of writers that are gone (their lock is free; the unfinished moves of one
    undone first), except those of the writer ``own``. Returns the files left in place because their writer still
    runs, or cannot be told to be gone (logged)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    by_token: dict[str, list[str]] = {}
    for entry in names:
        match = LEFTOVER_RE.match(entry)
        if match is not None and match["token"] != own and (match["kind"] != "lock" or match["name"] == LOCK_NAME):
            by_token.setdefault(match["token"], []).append(entry)
    left = []
    for token, entries in sorted(by_token.items()):
        state, fd = _writer_state(folder, token)
        if state is not True:
            paths = [os.path.join(folder, e) for e in sorted(entries) if not e.endswith(".lock")]
            left += paths
            for path in paths:
                log.warning("H3 fused NVFP4: %s is in use by a write in progress: left in place" if state is False
                            else "H3 fused NVFP4: %s was left by a write that may still run (its lock cannot be "
                            "checked here): left in place; delete it if no write is in progress", path)
            continue
        try:
            moves = _journal(fd, token) if fd is not None else None
            if moves:
                _undo_unfinished_moves(folder, moves)
            for entry in sorted(entries, key=lambda e: e.endswith(".lock")):  # the lock file last
                path = os.path.join(folder, entry)
                try:
                    os.unlink(path)
                    if not entry.endswith(".lock"):
                        log.warning("H3 fused NVFP4: removed %s, left by an interrupted write", path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("H3 fused NVFP4: could not remove %s, left by an interrupted write: %s", path, exc)
        finally:
            if fd is not None:
                os.close(fd)
    return left


def write_safetensors(dest_path, tensors: Sequence[PlannedTensor], metadata: Mapping[str, str] | None = None, *,
                      progress: Progress | None = None, overwrite: bool = False) -> int:
    """Write ``tensors`` in this order as a safetensors file at ``dest_path`` atomically (one
    :class:`StagedWrite`); returns its size. See :meth:`StagedWrite.stage_safetensors`."""
    dest = os.path.abspath(os.fspath(dest_path))
    folder = check_destination(dest, overwrite)  # before the lock file is made
    _check_checkpoint_name(dest)
    with StagedWrite(folder) as staged:
        size = staged.stage_safetensors(dest, tensors, metadata, progress=progress, overwrite=overwrite)
        staged.commit(overwrite)
    return size


def file_order(single: Iterable[PlannedTensor], groups: Sequence[Sequence[PlannedTensor]]) -> list[PlannedTensor]:
    """8- and 4-byte tensors, then the groups, then 2- and 1-byte tensors, by name within each.

    Every tensor then starts at a multiple of its element size, as safetensors' own writer keeps them (ComfyUI's
    mmap loader views the bytes in place); a group (one converted layer: fp32 scalars, then bytes, a multiple of
    4 in all) is written in one piece, so one layer's quantization is held at a time."""
    by_size = sorted(single, key=lambda t: (-ITEMSIZE[t.dtype], t.name))
    wide = [t for t in by_size if ITEMSIZE[t.dtype] >= 4]
    narrow = [t for t in by_size if ITEMSIZE[t.dtype] < 4]
    return wide + [t for group in groups for t in group] + narrow
