"""Build and launch the CUDA kernels without a CUDA toolkit.

The ``.cu`` sources in ``csrc/`` (one per kernel family: packs.cu, residual_norm.cu, rms_rope.cu, with their
shared device code in nvfp4_common.cuh) are compiled at first use with NVRTC for the exact architecture of the GPU
(``sm_<major><minor>a``: the arch-specific target enables sm_100+/sm_120+ instructions such as the E2M1
conversion), cached on disk, loaded with the CUDA driver API and launched on torch's current stream.

Only ``ctypes`` is used: NVRTC ships with CUDA-13 builds of torch (``nvidia/cu13/lib`` on Linux,
``nvidia/cu13/bin/x86_64`` or ``torch/lib`` on Windows) and the driver is ``libcuda`` / ``nvcuda.dll``, so the pack
needs no compiler, no extra Python package and no build step at install time.

Cache: ``$H3_FUSED_NVFP4_CACHE`` or ``~/.cache/h3_fused_nvfp4``; one cubin per (schema version, source and
header digests, options, arch, NVRTC version), written atomically with a SHA-256 trailer. A file whose trailer
does not match (truncated, corrupt) or that the driver refuses is rebuilt, not loaded. An in-memory dict sits in
front.

``H3_FUSED_NVFP4_EMULATE_BLACKWELL=1`` builds the Blackwell code path with a software model of its Blackwell-only
instructions (csrc/nvfp4_common.cuh), for running the GPU parity suite on a Hopper development GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.util
import logging
import os
import pathlib
import stat
import sys
import tempfile
import threading

log = logging.getLogger("h3_fused_nvfp4")

KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "csrc"
HEADERS = ("nvfp4_common.cuh",)
SOURCES = ("packs.cu", "residual_norm.cu", "rms_rope.cu")  # the first: the default of the functions below
CACHE_SCHEMA = 2
CUBIN_TRAILER = b"H3FN"  # + 32-byte SHA-256 of the cubin
# Arch-specific targets we build for; sm_90a is the Hopper development target (software E2M1).
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_110a", "sm_120a", "sm_121a")
NVRTC_OPTIONS = ("--std=c++17",)  # no fast math: kernels spell out every approximate instruction in PTX


class KernelBuildError(RuntimeError):
    """NVRTC or the driver could not build or load a kernel; the caller falls back to ComfyUI's path."""


# ---- library discovery -----------------------------------------------------------------------------------

# Where NVRTC may live, tried in this order: the CUDA wheels torch depends on (Linux nvidia/cu13/lib, Windows
# nvidia/cu13/bin/x86_64), the older per-library wheels, torch's own lib folder (torch's CUDA builds for Windows carry
# their CUDA DLLs there), a CUDA toolkit (CUDA 13 on Windows keeps its DLLs in bin\x64), then the loader's path.
NVRTC_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cu13/bin/x86_64", "nvidia/cu13/bin", "nvidia/cuda_nvrtc/lib",
                    "nvidia/cuda_nvrtc/bin", "nvidia/cu12/lib")
NVRTC_TOOLKIT_DIRS = ("lib64", "lib", "bin/x64", "bin")
DEFAULT_CUDA_HOME = "/usr/local/cuda"
NVRTC_NAMES = ("libnvrtc.so*", "nvrtc64_*.dll")
NVRTC_BUILTINS_NAMES = ("libnvrtc-builtins.so.*", "nvrtc-builtins64_*.dll")


def _libraries_in(folder: str, patterns: tuple) -> list[str]:
    """Files in ``folder`` matching ``patterns``, the highest version first; the .alt builds NVIDIA ships beside the
    libraries are skipped."""
    found: list[str] = []
    for pattern in patterns:  # the folder as it is named (a "[" in it is no pattern)
        found += sorted(glob.glob(os.path.join(glob.escape(folder), pattern)), reverse=True)
    return [p for p in found if ".alt." not in os.path.basename(p)]


def _nvrtc_folders() -> list[str]:
    """The folders NVRTC is looked for in, in order (the loader's path comes after them)."""
    folders = [os.path.join(entry, sub) for entry in sys.path for sub in NVRTC_WHEEL_DIRS]
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.submodule_search_locations:
        folders += [os.path.join(location, "lib") for location in torch_spec.submodule_search_locations]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), DEFAULT_CUDA_HOME):
        if home:
            folders += [os.path.join(home, sub) for sub in NVRTC_TOOLKIT_DIRS]
    return list(dict.fromkeys(folders))


def _candidate_nvrtc_paths() -> list[str]:
    paths = [path for folder in _nvrtc_folders() for path in _libraries_in(folder, NVRTC_NAMES)]
    found = ctypes.util.find_library("nvrtc")
    if found:
        paths.append(found)
    return list(dict.fromkeys(paths))


_nvrtc = None
_nvrtc_lock = threading.Lock()
_dll_directories: list = []  # os.add_dll_directory handles: the directory stays searchable while one is held


def nvrtc() -> ctypes.CDLL:
    """The NVRTC shared library (raises KernelBuildError if none is found)."""
    global _nvrtc
    with _nvrtc_lock:
        if _nvrtc is None:
            errors = []
            for path in _candidate_nvrtc_paths():
                try:
                    # NVRTC loads its builtins library by name; load the sibling copy first so that works without
                    # LD_LIBRARY_PATH / PATH (pip-installed CUDA libraries are not on the loader's path).
                    folder = os.path.dirname(path)
                    if folder and hasattr(os, "add_dll_directory"):  # Windows: where the DLLs' DLLs are looked for
                        _dll_directories.append(os.add_dll_directory(folder))
                    for builtins in _libraries_in(folder, NVRTC_BUILTINS_NAMES) if folder else ():
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    lib = ctypes.CDLL(path)
                    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
                    _nvrtc = lib
                    break
                except OSError as exc:
                    errors.append(f"{path}: {exc}")
            if _nvrtc is None:
                raise KernelBuildError(_nvrtc_missing(errors))
        return _nvrtc


def _nvrtc_missing(errors: list[str]) -> str:
    """Why no NVRTC could be loaded, and what to do, for the torch that is installed."""
    torch = sys.modules.get("torch")  # not imported here: the release check runs without torch
    version = getattr(torch, "__version__", None)
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if errors:
        found = "found but could not load: " + "; ".join(errors)
    else:
        searched = [folder for folder in _nvrtc_folders() if os.path.isdir(folder)]
        found = ("no libnvrtc / nvrtc64_*.dll in " + (", ".join(searched) if searched else "any of torch's CUDA wheel "
                 "folders, torch/lib, CUDA_HOME or CUDA_PATH (none of them exists)") + " or on the loader's path")
    if cuda and str(cuda).split(".")[0] == "13":
        return (f"NVRTC not found: torch {version} is a CUDA {cuda} build, whose NVRTC comes with its CUDA wheels "
                f"(nvidia-cuda-nvrtc); {found}. Reinstall those wheels with this Python, or set CUDA_HOME to a CUDA "
                "13 toolkit")
    build = f" (torch {version} is built for CUDA {cuda})" if version else ""
    return (f"NVRTC not found{build}: install a CUDA 13 build of torch, or set CUDA_HOME to a CUDA 13 toolkit; "
            + found)


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check_nvrtc(result: int, what: str) -> None:
    if result != 0:
        raise KernelBuildError(f"{what} failed: {nvrtc().nvrtcGetErrorString(result).decode()}")


# ---- compilation -----------------------------------------------------------------------------------------

def _read(name: str) -> str:
    return (KERNEL_DIR / name).read_text()


def source_digest() -> str:
    h = hashlib.sha256()
    for name in HEADERS + SOURCES:
        h.update(name.encode())
        h.update(_read(name).encode())
    return h.hexdigest()


CACHE_ENV = "H3_FUSED_NVFP4_CACHE"
_warned_cache_settings: set[str] = set()


def cache_dir() -> pathlib.Path:
    """``$H3_FUSED_NVFP4_CACHE`` (``~`` expanded) or ``~/.cache/h3_fused_nvfp4``. A relative or blank value would
    put the cache wherever the process happens to start: the default is used instead, with a warning once."""
    default = pathlib.Path(os.path.expanduser("~"), ".cache", "h3_fused_nvfp4")
    value = os.environ.get(CACHE_ENV, "")
    if value == "":  # unset
        return default
    root = os.path.expanduser(value)
    if value.strip() and os.path.isabs(root):
        return pathlib.Path(root)
    if value not in _warned_cache_settings:
        _warned_cache_settings.add(value)
        what = "is blank" if not value.strip() else "is not an absolute path"
        log.warning("H3 fused NVFP4: %s=%r %s; using the default cache folder %s", CACHE_ENV, value, what, default)
    return default


def _nvrtc_compile(arch: str, source: str, defines: tuple, get_size: str, get_data: str) -> bytes:
    """Compile ``source`` with NVRTC for ``--gpu-architecture=arch`` and return one output (cubin or PTX)."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    header_names = [h.encode() for h in HEADERS]
    header_texts = [_read(h).encode() for h in HEADERS]
    n = len(HEADERS)
    _check_nvrtc(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), _read(source).encode(), source.encode(), n,
            (ctypes.c_char_p * n)(*header_texts), (ctypes.c_char_p * n)(*header_names),
        ),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), *[o.encode() for o in NVRTC_OPTIONS],
                   *[f"-D{k}={v}".encode() for k, v in defines]]
        result = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            raise KernelBuildError(f"NVRTC failed to compile {source} for {arch}:\n"
                                   f"{buf.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(getattr(lib, get_size)(prog, ctypes.byref(size)), get_size)
        buf = ctypes.create_string_buffer(size.value)
        _check_nvrtc(getattr(lib, get_data)(prog, buf), get_data)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cubin(arch: str, source: str = SOURCES[0], defines: tuple = ()) -> bytes:
    """Compile one source for ``arch`` (e.g. ``"sm_121a"``) with NVRTC and return the cubin bytes.

    ``defines``: ``((name, value), ...)`` passed as ``-D`` (kernels/cuda_ops.py kernel_defines: the launch
    constants)."""
    return _nvrtc_compile(arch, source, defines, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")


def compile_ptx(arch: str, source: str = SOURCES[0], defines: tuple = ()) -> str:
    """The PTX NVRTC generates for ``arch`` (``"sm_100a"`` is compiled as ``compute_100a``), for inspection:
    tests check which instructions each target uses (e.g. the hardware E2M1 conversion on sm_100a+)."""
    virtual = "compute_" + arch[len("sm_"):] if arch.startswith("sm_") else arch
    ptx = _nvrtc_compile(virtual, source, defines, "nvrtcGetPTXSize", "nvrtcGetPTX")
    return ptx.rstrip(b"\0").decode()


def cubin_cache_path(arch: str, source: str = SOURCES[0], defines: tuple = ()) -> pathlib.Path:
    key = hashlib.sha256(
        repr((CACHE_SCHEMA, source, source_digest(), _read(source), NVRTC_OPTIONS, defines, arch,
              nvrtc_version())).encode()
    ).hexdigest()[:32]
    return cache_dir() / f"{pathlib.Path(source).stem}-{arch}-{key}.cubin"


CUBIN_MAX_BYTES = 64 << 20


def read_cache_file(path: pathlib.Path, max_bytes: int) -> bytes | None:
    """The bytes of the regular file at ``path``, or None: missing, a link, a FIFO or device, larger than
    ``max_bytes``, or unreadable. Never follows a link, never blocks on a FIFO, never reads past ``max_bytes``."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        if path.is_symlink():
            log.warning("H3 fused NVFP4: ignoring cache file %s: it is a symbolic link", path)
            return None
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            log.warning("H3 fused NVFP4: ignoring cache file %s: not a regular file", path)
            return None
        if info.st_size > max_bytes:
            log.warning("H3 fused NVFP4: ignoring cache file %s: %d bytes, more than a cache file holds", path,
                        info.st_size)
            return None
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= max_bytes else None
    except OSError:
        return None
    finally:
        os.close(fd)


_warned_folders: set[str] = set()


def warn_if_shared(folder: pathlib.Path) -> None:
    """Log once when a folder the files in ``folder`` rely on can be written by other users, who could hand this
    process kernels or self-check verdicts: ``folder`` itself, every folder above it up to the cache folder (the
    verdicts live in its ``selfcheck/``), and the one above that."""
    root = cache_dir()
    chain = [folder]
    while chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    chain.append(chain[-1].parent)
    for candidate in chain:
        try:
            mode = candidate.stat().st_mode
        except OSError:
            continue
        # a folder above like /tmp (sticky bit) lets others create names, not replace ours
        writable_by_others = mode & stat.S_IWOTH and (candidate == folder or not mode & stat.S_ISVTX)
        if writable_by_others and str(candidate) not in _warned_folders:
            _warned_folders.add(str(candidate))
            log.warning("H3 fused NVFP4: the cache folder %s is writable by other users, who could replace the "
                        "kernels or the self-check verdicts it holds; set H3_FUSED_NVFP4_CACHE to a folder only "
                        "you can write", candidate)


def _read_cached(path: pathlib.Path) -> bytes | None:
    """The cubin stored at ``path`` if its trailer checks out, else None (and the bad file is removed)."""
    warn_if_shared(path.parent)
    data = read_cache_file(path, CUBIN_MAX_BYTES)
    if data is None:
        return None
    cubin, trailer = data[:-36], data[-36:]
    if len(data) > 36 and trailer[:4] == CUBIN_TRAILER and hashlib.sha256(cubin).digest() == trailer[4:]:
        return cubin
    log.warning("H3 fused NVFP4: kernel cache file %s is corrupt or truncated; rebuilding it", path)
    discard_cached(path)
    return None


def discard_cached(path: pathlib.Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import (setting it is process-wide)


def atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``; the file gets
    the permissions of a normally created one (mkstemp's are owner-only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        discard_cached(pathlib.Path(tmp))
        raise


def cached_cubin(arch: str, source: str = SOURCES[0], defines: tuple = ()) -> bytes:
    """``source``: a file name in KERNEL_DIR, or an absolute path (test kernels that include our headers)."""
    path = cubin_cache_path(arch, source, defines)
    cubin = _read_cached(path)
    if cubin is not None:
        return cubin
    cubin = compile_cubin(arch, source, defines)
    try:
        atomic_write(path, cubin + CUBIN_TRAILER + hashlib.sha256(cubin).digest())
    except OSError as exc:  # a read-only home is not a reason to fail
        log.debug("could not cache %s: %s", path, exc)
    return cubin


# ---- driver: load and launch -----------------------------------------------------------------------------

_driver = None


def driver() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise KernelBuildError("the CUDA driver library (libcuda) was not found")
        lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ]
        _check_cu(lib, lib.cuInit(0), "cuInit")
        _driver = lib
    return _driver


def _check_cu(lib, result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(msg))
        raise KernelBuildError(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}a"


class Module:
    """The compiled kernels of one source on one device."""

    def __init__(self, device_index: int, source: str = SOURCES[0], defines: tuple = ()):
        import torch

        self.device_index = device_index
        self.defines = dict(defines)
        self.arch = device_arch(device_index)
        if self.arch not in SUPPORTED_ARCHS:
            raise KernelBuildError(f"no kernels for {self.arch} (supported: {', '.join(SUPPORTED_ARCHS)})")
        lib = driver()
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # makes the device's primary context current on this thread
            self._context = ctypes.c_void_p()
            _check_cu(lib, lib.cuCtxGetCurrent(ctypes.byref(self._context)), "cuCtxGetCurrent")
            self._module = ctypes.c_void_p()
            for attempt in range(2):
                cubin = cached_cubin(self.arch, source, defines)
                self._image = ctypes.create_string_buffer(cubin, len(cubin))
                result = lib.cuModuleLoadData(ctypes.byref(self._module), self._image)
                if result == 0 or attempt == 1:
                    break
                # a cached file the driver refuses (written by another driver, damaged): rebuild it once
                log.warning("H3 fused NVFP4: the driver refused the cached kernels for %s (CUDA error %d); rebuilding",
                            self.arch, result)
                discard_cached(cubin_cache_path(self.arch, source, defines))
            _check_cu(lib, result, "cuModuleLoadData")
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._shared_limit: dict[str, int] = {}
        self._resident: dict[tuple, int] = {}
        props = torch.cuda.get_device_properties(device_index)
        self.sm_count = props.multi_processor_count
        self.max_shared_per_block = self._device_attribute(97)  # CU_..._MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

    def _device_attribute(self, attribute: int) -> int:
        lib = driver()
        dev, value = ctypes.c_int(), ctypes.c_int()
        _check_cu(lib, lib.cuDeviceGet(ctypes.byref(dev), self.device_index), "cuDeviceGet")
        _check_cu(lib, lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev), "cuDeviceGetAttribute")
        return value.value

    def function(self, name: str) -> ctypes.c_void_p:
        fn = self._functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            _check_cu(driver(), driver().cuModuleGetFunction(ctypes.byref(fn), self._module, name.encode()),
                      f"cuModuleGetFunction({name})")
            self._functions[name] = fn
        return fn

    def _allow_shared(self, name: str, fn, shared_bytes: int) -> None:
        """Above 48 KB of dynamic shared memory a kernel's limit must be raised (opt-in), once."""
        if shared_bytes > self._shared_limit.get(name, 48 * 1024):
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check_cu(driver(), driver().cuFuncSetAttribute(fn, 8, shared_bytes), f"cuFuncSetAttribute({name})")
            self._shared_limit[name] = shared_bytes

    def resident_ctas(self, name: str, block: int, shared_bytes: int = 0) -> int:
        """CTAs of ``name`` one SM holds at once (the driver's occupancy calculator), at least 1; cached."""
        key = (name, block, shared_bytes)
        count = self._resident.get(key)
        if count is None:
            fn = self.function(name)
            self._allow_shared(name, fn, shared_bytes)
            value = ctypes.c_int()
            _check_cu(driver(), driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(value), fn, block, ctypes.c_size_t(shared_bytes)), f"occupancy of {name}")
            count = self._resident[key] = max(1, value.value)
        return count

    def launch(self, name: str, grid: int, block: int, params: ctypes.Structure, stream_handle: int,
               shared_bytes: int = 0) -> None:
        """Launch ``name`` with one by-value struct argument on the given raw CUDA stream (no sync).

        ``shared_bytes``: dynamic shared memory; above 48 KB the kernel's limit is raised once (opt-in)."""
        lib = driver()
        fn = self.function(name)
        self._allow_shared(name, fn, shared_bytes)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        result = lib.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared_bytes, stream_handle, args, None)
        if result == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread torch has not bound to this device yet
            lib.cuCtxSetCurrent(self._context)
            result = lib.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared_bytes, stream_handle, args, None)
        _check_cu(lib, result, f"cuLaunchKernel({name})")


_modules: dict[tuple, Module] = {}
_modules_lock = threading.Lock()


def module(device_index: int, source: str = SOURCES[0], defines: tuple = ()) -> Module:
    key = (device_index, source, defines)
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                mod = Module(device_index, source, defines)
                _modules[key] = mod
    return mod


def driver_version() -> str:
    """The driver build (NVML, e.g. "580.159.04"); the CUDA API version where NVML is missing; "none" without one."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
            return buf.value.decode()
    except (OSError, AttributeError):
        pass
    try:
        value = ctypes.c_int()
        driver().cuDriverGetVersion(ctypes.byref(value))
        return f"cuda {value.value // 1000}.{value.value % 1000 // 10}"
    except Exception:  # no driver: CPU
        return "none"
