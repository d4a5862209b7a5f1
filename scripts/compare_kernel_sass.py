"""Compare the GPU code of the kernels of two builds, kernel by kernel.

    python scripts/compare_kernel_sass.py OLD_REF [NEW_REF] [--archs sm_90a,sm_100a,...] [--compiler nvcc|nvrtc]
                                          [--renamed OLD_NAME=NEW_NAME ...]

Each side (a git commit, or the working tree when NEW_REF is left out) is built the way the pack builds it:
every source its kernels/runtime.py lists, with the -D options its kernels/cuda_ops.py (earlier kernels/ops.py)
kernel_defines(source) gives,
for each arch, and for sm_90a a second time with H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 (the Blackwell path on Hopper).
Both sides' own runtime.py and ops.py are loaded from their trees, so each uses its own sources, file layout and
defines. The cubins are disassembled with ``cuobjdump -sass`` and each kernel's listing (instructions, their
offsets in the function, encodings and scheduling annotations) is compared with the kernel of the same name on the
other side, ignoring only the file and section names, the listing's headers and the column padding.
Kernels that exist on one side only are listed; ``--renamed`` pairs a kernel of the old side with its new name
(``--renamed h3_gated_residual=fused_gated_residual``; a renamed source file needs nothing: kernels are matched by
name across every source). Exit status 0 when every kernel present on both sides is
identical, 1 otherwise.

Tools: nvcc (the NVCC variable, PATH, CUDA_HOME, /usr/local/cuda/bin) unless --compiler nvrtc, and a cuobjdump that
knows every arch asked for (the CUOBJDUMP variable, PATH, CUDA_HOME, /usr/local/cuda/bin, or the copy triton ships in
its nvidia backend; sm_121a needs CUDA 13's). Needs torch (ops.py imports it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_ARCHS = ("sm_90a", "sm_100a", "sm_120a", "sm_121a")
EMULATE_ENV = "H3_FUSED_NVFP4_EMULATE_BLACKWELL"


def _tool(name: str) -> str:
    found = os.environ.get(name.upper()) or shutil.which(name)
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        path = pathlib.Path(home) / "bin" / name
        if path.exists():
            return str(path)
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = pathlib.Path(location) / "backends" / "nvidia" / "bin" / name
            if path.exists():
                return str(path)
    sys.exit(f"{name} not found (PATH, CUDA_HOME, /usr/local/cuda/bin, triton's nvidia backend)")


def _extract(ref: str, into: pathlib.Path) -> pathlib.Path:
    """The tree of ``ref`` (the pack's Python and kernel sources) under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    tar_path = into / "tree.tar"
    tar_path.write_bytes(archive)
    tree = into / "tree"
    with tarfile.open(tar_path) as tar:
        tar.extractall(tree)
    return tree


def _load_side(tree: pathlib.Path, name: str):
    """runtime and ops of the tree, as a package of their own (the pack's __init__ and integration stay out)."""
    package = types.ModuleType(name)
    package.__path__ = [str(tree)]
    sys.modules[name] = package
    kernels = types.ModuleType(f"{name}.kernels")
    kernels.__path__ = [str(tree / "kernels")]
    sys.modules[f"{name}.kernels"] = kernels

    def load(module: str, path: pathlib.Path):
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
        return mod

    load(f"{name}.layout", tree / "layout.py")
    runtime = load(f"{name}.kernels.runtime", tree / "kernels" / "runtime.py")
    ops_path = tree / "kernels" / "cuda_ops.py"  # kernels/ops.py in trees before the layout of 5651caa
    ops = load(f"{name}.kernels.ops", ops_path if ops_path.exists() else tree / "kernels" / "ops.py")
    return runtime, ops


@contextlib.contextmanager
def _emulation(on: bool):
    old = os.environ.get(EMULATE_ENV)
    if on:
        os.environ[EMULATE_ENV] = "1"
    else:
        os.environ.pop(EMULATE_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EMULATE_ENV, None)
        else:
            os.environ[EMULATE_ENV] = old


def _build(side, arch: str, emulate: bool, compiler: str, workdir: pathlib.Path) -> list[tuple[str, bytes, tuple]]:
    """(source, cubin, defines) of every source of one side."""
    runtime, ops = side
    out = []
    for source in runtime.SOURCES:
        with _emulation(emulate):
            defines = tuple(ops.kernel_defines(source))
        if compiler == "nvrtc":
            cubin = runtime.compile_cubin(arch, source, defines)
        else:
            target = workdir / f"{pathlib.Path(source).stem}-{arch}.cubin"
            cmd = [_tool("nvcc"), "-std=c++17", "-cubin", f"-arch={arch}", *[f"-D{k}={v}" for k, v in defines],
                   str(runtime.KERNEL_DIR / source), "-o", str(target)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
            cubin = target.read_bytes()
        out.append((source, cubin, defines))
    return out


FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
HEADER = re.compile(r"^\s*(\.headerflags|code for sm_|\.target|Fatbin |\.section|\.elftype|arch = |code version|"
                    r"host = |compile_size|producer = )")


def _sass_by_kernel(cubin: bytes, workdir: pathlib.Path, label: str) -> dict[str, list[str]]:
    path = workdir / f"{label}.cubin"
    path.write_bytes(cubin)
    listing = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], check=True, capture_output=True,
                             text=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match.group(1), [])
            continue
        if current is None or not line.strip() or HEADER.match(line):
            continue
        current.append(" ".join(line.split()))  # the column padding depends on the longest line of the listing
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_ref")
    parser.add_argument("new_ref", nargs="?", help="default: the working tree")
    parser.add_argument("--archs", default=",".join(DEFAULT_ARCHS))
    parser.add_argument("--compiler", choices=("nvcc", "nvrtc"), default="nvcc")
    parser.add_argument("--renamed", action="append", default=[], metavar="OLD_NAME=NEW_NAME",
                        help="a kernel the new side calls by another name")
    args = parser.parse_args()
    renamed = dict(pair.split("=", 1) for pair in args.renamed)
    archs = [a for a in args.archs.split(",") if a]
    builds = [(arch, False) for arch in archs] + [("sm_90a", True)] * ("sm_90a" in archs)

    failures = 0
    with tempfile.TemporaryDirectory(prefix="sass-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "old").mkdir()
        old_side = _load_side(_extract(args.old_ref, tmp / "old"), "sass_old")
        if args.new_ref:
            (tmp / "new").mkdir()
            new_side = _load_side(_extract(args.new_ref, tmp / "new"), "sass_new")
        else:
            new_side = _load_side(ROOT, "sass_new")
        new_label = args.new_ref or "working tree"
        print(f"old: {args.old_ref} ({', '.join(old_side[0].SOURCES)})")
        print(f"new: {new_label} ({', '.join(new_side[0].SOURCES)})")
        for arch, emulate in builds:
            name = arch + (" emulated Blackwell" if emulate else "")
            kernels = {}
            for side_name, side in (("old", old_side), ("new", new_side)):
                merged: dict[str, list[str]] = {}
                for source, cubin, _ in _build(side, arch, emulate, args.compiler, tmp):
                    label = f"{side_name}-{pathlib.Path(source).stem}-{arch}-{int(emulate)}"
                    for kernel, sass in _sass_by_kernel(cubin, tmp, label).items():
                        kernel = renamed.get(kernel, kernel) if side_name == "old" else kernel
                        assert kernel not in merged, f"{kernel} defined twice on the {side_name} side"
                        merged[kernel] = sass
                kernels[side_name] = merged
            old, new = kernels["old"], kernels["new"]
            common = sorted(set(old) & set(new))
            differing = [k for k in common if old[k] != new[k]]
            print(f"{name}: {len(common)} kernels in both builds, {len(common) - len(differing)} identical SASS"
                  + (f", DIFFERENT: {', '.join(differing)}" if differing else ""))
            for kernel in differing:
                diff = [f"    old {a}\n    new {b}" for a, b in zip(old[kernel], new[kernel]) if a != b][:3]
                print(f"  {kernel}: {len(old[kernel])} vs {len(new[kernel])} lines; first differences:\n"
                      + "\n".join(diff))
            if set(old) - set(new):
                print(f"  only in the old build: {', '.join(sorted(set(old) - set(new)))}")
            if set(new) - set(old):
                print(f"  only in the new build: {', '.join(sorted(set(new) - set(old)))}")
            failures += len(differing) + (not common)
    print("identical" if failures == 0 else f"{failures} kernel listings differ")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
