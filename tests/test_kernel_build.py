"""The CUDA sources build for every target the pack supports, without a GPU.

* NVRTC (what the pack uses at run time; it ships with CUDA-13 builds of torch): every source compiles to a
  cubin for each supported arch-specific target, and the cubin holds every kernel entry point.
* nvcc, when one is on PATH: the same build, and ptxas reports no register spills.
* PTX: sm_100a and later use the hardware E2M1 conversion, sm_90a the software path.
* The Blackwell-path build for Hopper (NVFP4_EMULATE_BLACKWELL): no E2M1 instruction on sm_90a, and no effect on
  targets that have the instruction.
* Each source gets exactly the launch constants it uses (kernels/ops.py kernel_defines), and every constant of
  kernels/ops.py LAUNCH is used by some source.
* The test kernels of tests/kernels build with the constants their tests pass.
* The on-disk cubin cache: atomic writes, hits, keys that change with the sources, corrupt files rebuilt.

scripts/compare_kernel_sass.py OLD_REF compares the SASS of every kernel against an older build.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from parity import within

from h3_fused_nvfp4.kernels import cuda_ops as ops
from h3_fused_nvfp4.kernels import runtime

# The entry points kernels/ops.py looks up by name, per source (every source's entry points are checked; these must
# exist).
PACK_SOURCE = "packs.cu"
KERNELS_BY_SOURCE = {
    PACK_SOURCE: ("nvfp4_absmax_plain", "nvfp4_absmax_modulate", "nvfp4_absmax_swiglu", "nvfp4_pack_plain",
                  "nvfp4_pack_modulate", "nvfp4_pack_norm_modulate", "nvfp4_pack_swiglu_table",
                  "nvfp4_pack_swiglu_window", "nvfp4_absmax_prescale", "nvfp4_pack_prescale", "nvfp4_absmax_plain_f16",
                  "nvfp4_pack_plain_f16", "nvfp4_absmax_prescale_f16", "nvfp4_pack_prescale_f16",
                  # Z-Image's block
                  "nvfp4_pack_norm_scale", "nvfp4_pack_norm", "nvfp4_absmax_swiglu_pair",
                  "nvfp4_pack_swiglu_pair_table", "nvfp4_pack_swiglu_pair_window"),
    "residual_norm.cu": ("fused_gated_residual", "fused_row_norm_stats", "fused_row_norm_amax",
                         "fused_row_norm_residual_stats", "fused_row_norm_residual_amax", "fused_modulation_bounds",
                         # Z-Image's block
                         "fused_row_norm_amax_scale", "fused_row_norm_amax_norm", "fused_modulation_bounds_scale",
                         "fused_norm_bounds",
                         "fused_post_norm_residual_gated_stats", "fused_post_norm_residual_gated_amax_scale",
                         "fused_post_norm_residual_stats", "fused_post_norm_residual_amax_norm",
                         "fused_post_norm_residual_gated_stats_from", "fused_post_norm_residual_gated_amax_scale_from",
                         "fused_post_norm_residual_stats_from", "fused_post_norm_residual_amax_norm_from"),
    "rms_rope.cu": ("fused_rms_rope_split_half",),
}
# The kernels of a LayerNorm block (Wan): bf16, and fp16 with the _f16 suffix.
LAYER_NORM_BLOCK_KERNELS = {
    PACK_SOURCE: ("nvfp4_absmax_layer_norm_modulate", "nvfp4_pack_layer_norm_modulate",
                  "nvfp4_absmax_layer_norm_affine", "nvfp4_pack_layer_norm_affine", "nvfp4_absmax_gelu",
                  "nvfp4_pack_gelu", "nvfp4_pack_gelu_table",
                  "nvfp4_absmax_layer_norm_modulate_f16", "nvfp4_pack_layer_norm_modulate_f16",
                  "nvfp4_absmax_layer_norm_affine_f16", "nvfp4_pack_layer_norm_affine_f16", "nvfp4_absmax_gelu_f16",
                  "nvfp4_pack_gelu_f16", "nvfp4_pack_gelu_table_f16"),
    "residual_norm.cu": ("fused_layer_norm_stats", "fused_layer_norm_modulated_amax", "fused_layer_norm_affine_amax",
                         "fused_gated_residual_layer_norm_stats", "fused_gated_residual_layer_norm_modulated_amax",
                         "fused_gated_residual_layer_norm_affine_amax", "fused_add_residual_layer_norm_stats",
                         "fused_add_residual_layer_norm_modulated_amax", "fused_add_residual_layer_norm_affine_amax",
                         "fused_layer_norm_stats_f16", "fused_layer_norm_modulated_amax_f16",
                         "fused_layer_norm_affine_amax_f16", "fused_gated_residual_layer_norm_stats_f16",
                         "fused_gated_residual_layer_norm_modulated_amax_f16",
                         "fused_gated_residual_layer_norm_affine_amax_f16",
                         "fused_add_residual_layer_norm_stats_f16",
                         "fused_add_residual_layer_norm_modulated_amax_f16",
                         "fused_add_residual_layer_norm_affine_amax_f16", "fused_rms_norm_rope",
                         "fused_rms_norm_rows", "fused_rms_norm_rope_f16", "fused_rms_norm_rows_f16"),
}
for _source, _kernels in LAYER_NORM_BLOCK_KERNELS.items():
    KERNELS_BY_SOURCE[_source] += _kernels
KERNELS = KERNELS_BY_SOURCE[PACK_SOURCE]
ARITH_SOURCE = pathlib.Path(__file__).resolve().parent / "kernels" / "arith_check.cu"
EMULATE = (("NVFP4_EMULATE_BLACKWELL", 1),)
# Targets that must build (GB10 and RTX 50 are sm_121/sm_120, B200 sm_100, H200 the sm_90 development target).
REQUIRED_ARCHS = ("sm_90a", "sm_100a", "sm_120a", "sm_121a")
HW_E2M1 = "cvt.rn.satfinite.e2m1x2.f32"


def _entry_points(source: str) -> set[str]:
    text = (runtime.KERNEL_DIR / source).read_text()
    return set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(', text))


def test_sources_define_the_kernels():
    assert set(KERNELS_BY_SOURCE) == set(runtime.SOURCES) and runtime.SOURCES[0] == PACK_SOURCE
    for source, kernels in KERNELS_BY_SOURCE.items():
        found = _entry_points(source)
        assert set(kernels) == found, f"{source}: expected {sorted(kernels)}, found {sorted(found)}"
    unlisted = sorted(p.name for p in runtime.KERNEL_DIR.glob("*.cu") if p.name not in runtime.SOURCES)
    assert not unlisted, f"kernels/csrc sources not in runtime.SOURCES (never built or cached): {unlisted}"
    assert not list(runtime.KERNEL_DIR.parent.glob("*.cu*")), "CUDA sources belong in kernels/csrc"
    headers = sorted(p.name for p in runtime.KERNEL_DIR.glob("*.cuh"))
    assert headers == sorted(runtime.HEADERS), f"headers {headers} vs runtime.HEADERS {runtime.HEADERS}"
    assert set(REQUIRED_ARCHS) <= set(runtime.SUPPORTED_ARCHS)


def _macros_used(text: str) -> set[str]:
    return set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", re.sub(r"//[^\n]*", "", text)))


@pytest.mark.parametrize("source", runtime.SOURCES)
def test_each_source_gets_the_constants_it_uses(source, monkeypatch):
    """kernel_defines(source): the LAUNCH / shape constants the source (or the shared header, for what the source
    calls) names, and no others; every LAUNCH constant goes to some source."""
    monkeypatch.delenv(ops.EMULATE_BLACKWELL_ENV, raising=False)
    names = {name for name, _ in ops.kernel_defines(source)}
    text = (runtime.KERNEL_DIR / source).read_text()
    used = _macros_used(text)
    if source == PACK_SOURCE:  # the silu window lookup of the shared header
        used |= {"SILU_WINDOW", "SILU_WINDOW_LO"}
    assert names <= used, f"{source} is built with constants it does not use: {sorted(names - used)}"
    launch_like = set(ops.LAUNCH) | {"SILU_WINDOW", "SILU_WINDOW_LO"} | {name for name, _ in ops.ROPE_DEFINES}
    missing = sorted((used & launch_like) - names)
    assert not missing, f"{source} uses {missing} but kernel_defines does not pass them"
    every = {name for s in runtime.SOURCES for name, _ in ops.kernel_defines(s)}
    assert set(ops.LAUNCH) <= every, f"LAUNCH constants no source uses: {sorted(set(ops.LAUNCH) - every)}"
    monkeypatch.setenv(ops.EMULATE_BLACKWELL_ENV, "1")
    emulated = ops.kernel_defines(source)
    assert (("NVFP4_EMULATE_BLACKWELL", 1) in emulated) == (source == PACK_SOURCE), emulated


# ---- NVRTC -----------------------------------------------------------------------------------------------

def _require_nvrtc():
    try:
        runtime.nvrtc()
    except runtime.KernelBuildError as exc:
        if os.environ.get("CI"):  # CI installs the CUDA-13 torch wheel: NVRTC missing there is a failure
            raise
        pytest.skip(f"NVRTC not available (install the CUDA-13 torch wheel, ./dev.sh setup does): {exc}")


_cubins: dict[tuple[str, str], bytes] = {}


def _nvrtc_cubin(arch: str, source: str) -> bytes:
    key = (arch, source)
    if key not in _cubins:
        _cubins[key] = runtime.compile_cubin(arch, source, ops.kernel_defines(source))
    return _cubins[key]


def test_sources_refuse_to_build_without_the_launch_constants():
    """kernels/ops.py LAUNCH is the one source of the launch shape: a build without it fails loudly."""
    _require_nvrtc()
    for source in runtime.SOURCES:
        with pytest.raises(runtime.KernelBuildError, match="passes"):
            runtime.compile_cubin("sm_90a", source)


def test_arith_check_kernels_build():
    """tests/kernels/arith_check.cu (the exhaustive GPU checks of tests/test_gpu_arith.py) builds with the
    constants that test passes."""
    _require_nvrtc()
    from test_gpu_arith import arith_defines

    cubin = runtime.compile_cubin("sm_90a", str(ARITH_SOURCE), arith_defines())
    for kernel in ("check_bf16x2_ops", "check_e2m1_codes", "check_silu", "check_silu_window_aligned",
                   "check_silu_window_straddling"):
        assert kernel.encode() + b"\0" in cubin, kernel


@pytest.mark.parametrize("source", runtime.SOURCES)
@pytest.mark.parametrize("arch", runtime.SUPPORTED_ARCHS)
def test_nvrtc_builds_every_kernel(arch, source):
    _require_nvrtc()
    cubin = _nvrtc_cubin(arch, source)
    assert len(cubin) > 0, f"empty cubin for {source} {arch}"
    assert cubin[:4] == b"\x7fELF", f"{source} {arch}: not an ELF image"
    # ELF symbol names are NUL-terminated in .strtab; the kernel names also head the .nv.info.<name> sections.
    missing = [k for k in sorted(_entry_points(source)) if k.encode() + b"\0" not in cubin]
    assert not missing, f"{source} {arch}: entry points missing from the cubin: {missing}"


@pytest.mark.parametrize("arch", runtime.SUPPORTED_ARCHS)
def test_ptx_uses_hardware_e2m1_from_sm100(arch):
    _require_nvrtc()
    ptx = runtime.compile_ptx(arch, PACK_SOURCE, ops.kernel_defines())
    assert f".target {arch}" in ptx, f"compile_ptx({arch}) produced PTX for another target"
    for kernel in KERNELS:
        assert f".entry {kernel}(" in ptx, f"{arch}: no .entry {kernel} in the PTX"
    major = int(re.match(r"sm_(\d+)", arch).group(1)) // 10
    if major >= 10:
        # A miss here is silent at run time (the software path gives the same bytes, only slower).
        assert HW_E2M1 in ptx, (f"{arch} should use the hardware E2M1 conversion ({HW_E2M1}) "
                                "but builds the software path")
    else:
        assert HW_E2M1 not in ptx, f"{arch} has no E2M1 instruction; the software path should be built"


def test_blackwell_path_builds_for_hopper_with_modelled_instructions():
    """NVFP4_EMULATE_BLACKWELL compiles the sm_100+ code path on sm_90a with the E2M1 instruction modelled in
    software (so the GPU suite can run it on a Hopper GPU); on Blackwell targets it changes nothing. The other sources
    have no E2M1 code: kernel_defines does not pass it to them."""
    _require_nvrtc()
    hopper = runtime.compile_ptx("sm_90a", PACK_SOURCE, ops.kernel_defines())
    emulated = runtime.compile_ptx("sm_90a", PACK_SOURCE, ops.kernel_defines() + EMULATE)
    assert HW_E2M1 not in emulated and emulated != hopper
    assert all(f".entry {k}(" in emulated for k in KERNELS)
    for arch in ("sm_100a", "sm_121a"):
        assert runtime.compile_ptx(arch, PACK_SOURCE, ops.kernel_defines() + EMULATE) == \
            runtime.compile_ptx(arch, PACK_SOURCE, ops.kernel_defines())


# ---- nvcc ------------------------------------------------------------------------------------------------

def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH (the NVRTC build above is what the pack uses; nvcc adds the ptxas spill report)")
    return nvcc


def _nvcc_supports(nvcc: str, arch: str) -> bool:
    listed = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)  # lists sm_90, not sm_90a
    return listed.returncode != 0 or arch.rstrip("af") in listed.stdout.split()


@pytest.mark.parametrize("source", runtime.SOURCES)
@pytest.mark.parametrize("arch", REQUIRED_ARCHS)
def test_nvcc_builds_without_spills(arch, source, tmp_path):
    nvcc = _nvcc()
    if not _nvcc_supports(nvcc, arch):
        pytest.skip(f"this nvcc does not know {arch}")
    out = tmp_path / f"{arch}.cubin"
    cmd = [nvcc, "-std=c++17", "-cubin", f"-arch={arch}", "-Xptxas", "-v",
           *[f"-D{k}={v}" for k, v in ops.kernel_defines(source)], str(runtime.KERNEL_DIR / source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log}"
    cubin = out.read_bytes()
    assert len(cubin) > 0 and cubin[:4] == b"\x7fELF"
    expected = sorted(_entry_points(source))
    missing = [k for k in expected if k.encode() + b"\0" not in cubin]
    assert not missing, f"{source} {arch}: entry points missing from the nvcc cubin: {missing}"
    compiled = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sorted(compiled) == sorted(expected), f"ptxas compiled {compiled}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) >= len(expected), f"no spill report for every kernel in:\n{log}"
    spilling = [line for line in log.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert not spilling, f"{source} {arch}: register spills:\n{log}"


# ---- the cubin cache -------------------------------------------------------------------------------------

@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """cached_cubin with NVRTC replaced by a recorder, the cache in a fresh (not yet created) folder."""
    cache = tmp_path / "cache" / "nested"
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(cache))
    monkeypatch.setattr(runtime, "nvrtc_version", lambda: (13, 0))
    calls = []

    def compile_cubin(arch, source=runtime.SOURCES[0], defines=()):
        calls.append((arch, source, defines))
        return b"\x7fELF fake cubin " + f"{arch} {defines} #{len(calls)}".encode()

    monkeypatch.setattr(runtime, "compile_cubin", compile_cubin)
    return cache, calls


def _cached_files(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_cache_writes_atomically_then_hits(fake_build, monkeypatch):
    cache, calls = fake_build
    renames = []
    real_replace = os.replace

    def spy_replace(src, dst):
        renames.append((os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(runtime.os, "replace", spy_replace)
    first = runtime.cached_cubin("sm_121a")
    assert len(calls) == 1
    files = _cached_files(cache)
    assert len(files) == 1 and files[0].startswith("packs-sm_121a-") and files[0].endswith(".cubin"), files
    assert (cache / files[0]).read_bytes()[:len(first)] == first  # + the integrity trailer
    # Written to a temporary file in the same folder, then renamed over the final name (atomic on POSIX).
    assert len(renames) == 1
    src, dst = renames[0]
    assert os.path.dirname(src) == str(cache) and src != dst and dst == str(cache / files[0])
    assert not [f for f in files if f.endswith(".tmp")]

    def must_not_compile(*args, **kwargs):
        raise AssertionError("cache miss: compile_cubin was called although the cubin is on disk")

    monkeypatch.setattr(runtime, "compile_cubin", must_not_compile)
    assert runtime.cached_cubin("sm_121a") == first
    assert _cached_files(cache) == files


def test_cache_key_follows_sources_options_and_arch(fake_build, monkeypatch):
    cache, calls = fake_build
    runtime.cached_cubin("sm_100a")
    names = set(_cached_files(cache))
    assert len(names) == 1

    real_digest = runtime.source_digest()
    monkeypatch.setattr(runtime, "source_digest", lambda: "0" * 64 if real_digest != "0" * 64 else "1" * 64)
    runtime.cached_cubin("sm_100a")  # edited kernel sources -> a new file, not the stale cubin
    assert len(calls) == 2
    after_edit = set(_cached_files(cache))
    assert len(after_edit) == 2 and names < after_edit

    runtime.cached_cubin("sm_100a", defines=(("PLAIN_ITEMS", "2"),))
    runtime.cached_cubin("sm_120a")
    monkeypatch.setattr(runtime, "nvrtc_version", lambda: (13, 1))
    runtime.cached_cubin("sm_120a")
    assert len(calls) == 5
    assert len(_cached_files(cache)) == 5


def test_unwritable_cache_still_returns_the_cubin(fake_build, monkeypatch, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(blocker / "cache"))
    _, calls = fake_build
    cubin = runtime.cached_cubin("sm_90a")
    assert cubin.startswith(b"\x7fELF") and len(calls) == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "no trailer"])
def test_corrupt_cached_cubin_is_rebuilt_not_loaded(fake_build, damage):
    cache, calls = fake_build
    good = runtime.cached_cubin("sm_100a")
    (path,) = cache.iterdir()
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "flipped byte": data[:5] + bytes([data[5] ^ 1]) + data[6:],
               "empty": b"", "no trailer": good}[damage]
    path.write_bytes(damaged)
    assert runtime.cached_cubin("sm_100a").startswith(b"\x7fELF fake cubin sm_100a")
    assert len(calls) == 2, "the damaged file was loaded instead of rebuilt"
    assert path.read_bytes() != damaged and runtime.cached_cubin("sm_100a") is not None and len(calls) == 2


def test_nvrtc_is_looked_for_where_linux_and_windows_installs_keep_it(tmp_path, monkeypatch):
    """Linux and Windows layouts of torch's CUDA wheels, torch/lib (Windows CUDA builds of torch), a CUDA 13 toolkit
    on Windows (bin/x64): found in that order, NVIDIA's .alt builds and the builtins libraries never taken for NVRTC."""
    site, toolkit = tmp_path / "site", tmp_path / "cuda"
    files = ["nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc.alt.so.13",
             "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
             "nvidia/cu13/bin/x86_64/nvrtc64_130_0.dll", "nvidia/cu13/bin/x86_64/nvrtc64_130_0.alt.dll",
             "nvidia/cu13/bin/x86_64/nvrtc-builtins64_130.dll", "torch/lib/nvrtc64_130_0.dll"]
    for name in files:
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"")
    (toolkit / "bin" / "x64").mkdir(parents=True)
    (toolkit / "bin" / "x64" / "nvrtc64_130_0.dll").write_bytes(b"")
    monkeypatch.setattr(runtime.sys, "path", [str(site)])
    monkeypatch.setattr(runtime.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(site / "torch")]})())
    monkeypatch.setattr(runtime.ctypes.util, "find_library", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    found = [os.path.relpath(p, tmp_path) for p in runtime._candidate_nvrtc_paths()]
    assert found[:4] == [os.path.join("site", "nvidia", "cu13", "lib", "libnvrtc.so.13"),
                         os.path.join("site", "nvidia", "cu13", "bin", "x86_64", "nvrtc64_130_0.dll"),
                         os.path.join("site", "torch", "lib", "nvrtc64_130_0.dll"),
                         os.path.join("cuda", "bin", "x64", "nvrtc64_130_0.dll")]
    assert not [p for p in found if ".alt." in p or "builtins" in p] and len(found) == len(set(found))
    builtins = runtime._libraries_in(str(site / "nvidia/cu13/bin/x86_64"), runtime.NVRTC_BUILTINS_NAMES)
    assert [os.path.basename(b) for b in builtins] == ["nvrtc-builtins64_130.dll"]


def test_nvrtc_is_found_under_a_folder_name_with_brackets(tmp_path, monkeypatch):
    """A Python environment under a path like ``envs/[gpu]``: the folders are searched as they are named (glob
    patterns apply to the library names only)."""
    site = tmp_path / "envs [cu130]" / "[gpu]" / "site"
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    library = site / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
    library.write_bytes(b"")
    monkeypatch.setattr(runtime.sys, "path", [str(site)])
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(runtime.ctypes.util, "find_library", lambda name: None)
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert runtime._candidate_nvrtc_paths()[0] == str(library)


def test_no_nvrtc_says_where_it_looked_and_what_torch_is(tmp_path, monkeypatch):
    """With a CUDA 13 torch installed, the message does not tell the user to install one: it names the torch build
    and the folders searched."""
    monkeypatch.setattr(runtime.sys, "path", [str(tmp_path / "site")])
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(runtime.ctypes.util, "find_library", lambda name: None)
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "_nvrtc", None)
    monkeypatch.setattr(runtime, "DEFAULT_CUDA_HOME", str(tmp_path / "no toolkit"))
    (tmp_path / "site" / "nvidia" / "cu13" / "lib").mkdir(parents=True)  # the wheel's folder, without its library
    torch_module = type(sys)("torch")
    torch_module.__version__ = "2.11.0+cu130"
    torch_module.version = type(sys)("torch.version")
    torch_module.version.cuda = "13.0"
    monkeypatch.setitem(sys.modules, "torch", torch_module)
    with pytest.raises(runtime.KernelBuildError) as error:
        runtime.nvrtc()
    message = str(error.value)
    assert "torch 2.11.0+cu130 is a CUDA 13.0 build" in message and "install a CUDA 13" not in message, message
    assert str(tmp_path / "site" / "nvidia" / "cu13" / "lib") in message, message


def test_the_cache_folder_setting_is_read_as_a_user_means_it(tmp_path, monkeypatch, caplog):
    """``~`` is the home folder; a relative or blank value is not used silently: the default folder is, with a
    warning once."""
    monkeypatch.setattr(runtime, "_warned_cache_settings", set())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".cache" / "h3_fused_nvfp4"
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", "~/kernels")
    assert runtime.cache_dir() == tmp_path / "home" / "kernels"
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    for value in ("relative/cache", "   ", ""):
        monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", value)
        assert runtime.cache_dir() == default and runtime.cache_dir() == default, value
    warnings = [r.getMessage() for r in caplog.records if "H3_FUSED_NVFP4_CACHE" in r.getMessage()]
    assert len(warnings) == 2 and "relative/cache" in warnings[0] and "blank" in warnings[1], warnings
    assert not (tmp_path / "~").exists() and not (tmp_path / "relative").exists()


# ---- hostile cache paths -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "oversized", "link to another file"])
def test_a_hostile_cache_path_is_rebuilt_without_hanging_or_following_links(fake_build, kind, tmp_path, caplog):
    cache, calls = fake_build
    path = runtime.cubin_cache_path("sm_120a")
    cache.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the cache's to change")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "link to another file":
        os.symlink(victim, path)
    else:
        with open(path, "wb") as f:
            f.truncate(runtime.CUBIN_MAX_BYTES + 1)  # sparse: no disk used
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    cubin = within(30, lambda: runtime.cached_cubin("sm_120a"))
    assert cubin.startswith(b"\x7fELF fake cubin sm_120a") and len(calls) == 1, "not rebuilt"
    assert path.is_file() and not path.is_symlink() and path.read_bytes().startswith(cubin)
    assert victim.read_bytes() == b"not the cache's to change", "the write followed a planted link"
    assert any(str(path) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert within(30, lambda: runtime.cached_cubin("sm_120a")) == cubin and len(calls) == 1


def test_a_cache_folder_others_can_write_is_warned_about(fake_build, monkeypatch, caplog):
    cache, _ = fake_build
    monkeypatch.setattr(runtime, "_warned_folders", set())
    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    runtime.cached_cubin("sm_100a")
    runtime.cached_cubin("sm_100a")
    warnings = [r.getMessage() for r in caplog.records if "writable by other users" in r.getMessage()]
    assert len(warnings) == 1 and str(cache) in warnings[0] and "H3_FUSED_NVFP4_CACHE" in warnings[0]
