"""Check a torch release against one already checked: do the torch kernels whose arithmetic the fused path
reproduces bit for bit have the same GPU code?

    python scripts/check_torch_release.py OLD NEW [--work DIR] [--out JSON]

OLD and NEW are ``VERSION[:PLATFORM]`` (platform tag, default ``manylinux_2_28_x86_64``), e.g. ``2.14.1 2.15.0`` (a new
release) or ``2.15.0 2.15.0:manylinux_2_28_aarch64`` (the Arm build GB10 hosts install, against the x86 one).

The fused kernels reproduce, for bf16 operands, torch's CUDA ``rms_norm`` (``vectorized_layer_norm_kernel<BFloat16,
float, rms_norm=true>``: torch runs it for 8-byte aligned rows, and the pack folds only 16-byte aligned ones) and the
elementwise kernels of ComfyUI's modulation, SwiGLU and gated residuals (add, mul, silu, addcmul); for the LayerNorm
blocks (Wan, in fp16 and bf16) also torch's ``layer_norm`` (``vectorized_layer_norm_kernel<Half / BFloat16, float,
rms_norm=false>``, its Welford statistics and output), the fp16 ``rms_norm`` and the fp16 add and addcmul. (GELU needs
no check: its table is made by the running torch itself.) For each release
this downloads the torch wheel (``pip download --no-deps``, about 0.5 GB), extracts the sm_90 / sm_100 / sm_120
cubins of ``libtorch_cuda.so`` with cuobjdump (about 3 GB) and compares every instantiation of those kernels that
same-dtype operands run (vectorized, unrolled without casts, strided without casts): its floating-point, shuffle,
shared-memory and barrier instructions, in order, as

  identical   the same instructions, registers included
  renamed     the same instructions in the same order once registers, guard predicates and reuse hints are
              renamed away
  rescheduled the same instructions in another order (the compiler moves only independent instructions)
  different   other instructions or other counts of them: flagged, to be read (and the GPU parity tests run on
              that release)

What this compares is opcodes, modifiers and immediates, not which register feeds which operand: a change of the
order of a sum with the same instructions (a new association) would pass as renamed or rescheduled. It finds
changed operations, roundings, constants and reduction trees of another shape; the GPU parity tests on that release
and the first-use self-check on the user's GPU are what confirm the bits.

Instantiations are paired by name (anonymous-namespace hashes dropped), else by a signature that ignores a template
flag added with a false default; the unpaired ones are listed (torch 2.14 added vectorized_elementwise_kernel
variants that only sm_107 runs, CUDALoops.cuh ``use_sm107_optimizations``). Exit status 0 when nothing is flagged and
every kernel has a compared instantiation on every architecture; 1 otherwise. Needs pip and cuobjdump
(``$CUDA_HOME/bin``, ``PATH``, or the ``nvidia-cuda-cuobjdump`` wheel). A pip constraint file that caps torch blocks
the download: ``PIP_CONFIG_FILE=/dev/null`` ignores it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ARCHS = ("sm_90", "sm_100", "sm_120")
# kernel -> substrings every mangled name of its instantiations contains
KERNELS = {
    "rms_norm": ("vectorized_layer_norm_kernelIN3c108BFloat16EfLb1E",),
    "add": ("CUDAFunctor_add", "BFloat16"),
    "mul": ("MulFunctor", "BFloat16"),
    "silu": ("11silu_kernel", "BFloat16"),
    "addcmul": ("19addcmul_cuda_kernel", "BFloat16"),
    # the LayerNorm blocks (Wan); fp16 names also match complex<Half> instantiations, compared as well
    "layer_norm_f16": ("vectorized_layer_norm_kernelIN3c104HalfEfLb0E",),
    "layer_norm": ("vectorized_layer_norm_kernelIN3c108BFloat16EfLb0E",),
    "rms_norm_f16": ("vectorized_layer_norm_kernelIN3c104HalfEfLb1E",),
    "add_f16": ("CUDAFunctor_add", "4HalfE"),
    "addcmul_f16": ("19addcmul_cuda_kernel", "4HalfE"),
}
# Instantiations only mixed-dtype operands reach (gpu_kernel_impl's dynamic-casting paths).
CASTING = re.compile(r"LoadWithCast|StoreWithCast|15gpu_kernel_implI")
# What decides the bits: floating-point ops and conversions, and the shuffles, shared-memory traffic and barriers
# that fix a reduction's order.
COMPARED = re.compile(r"(F[A-Z0-9]*|H(FMA2|ADD2|MUL2|MNMX2|SETP2)|MUFU|I2F[A-Z0-9]*|SHFL|LDS|STS|BAR)(\.|\s|$)")
# HFMA2 R, -RZ, RZ, a, b is how the compiler writes a constant into a register (MOV's job, not compared either)
CONSTANT_MOVE = re.compile(r"^HFMA2(\.MMA)? \S+, -RZ, RZ, ")
GUARD = re.compile(r"^@!?U?P[0-9T]\s+")
# _GLOBAL__N__<hash>_<length>_<file>_cu_<hash>[_<number>]; the number runs into the next name's length prefix, which
# is the same on both sides
ANONYMOUS_NAMESPACE = re.compile(r"\d+_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}(?:_\d+)?")
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def normalized_name(mangled: str) -> str:
    """A mangled name without its anonymous-namespace hash (it changes with every build)."""
    return ANONYMOUS_NAMESPACE.sub("ANON", mangled)


VERDICTS = ("identical", "renamed", "rescheduled", "different")


def signature_key(name: str) -> str:
    """Pairs an instantiation across a template parameter added with a false default (torch 2.14 gave
    vectorized_elementwise_kernel a trailing ``bool``: ``...Lb0EEEviT0_T1_``)."""
    return name.replace("Lb0E", "")


def paired(a: dict, b: dict) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(old name, new name) pairs: the same normalized name, else the one instantiation of the same
    :func:`signature_key`; then the names left on each side."""
    pairs = [(n, n) for n in sorted(set(a) & set(b))]
    left_a, left_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    for n in list(left_a):
        matches = [m for m in left_b if signature_key(m) == signature_key(n)]
        if len(matches) == 1:
            pairs.append((n, matches[0]))
            left_a.remove(n)
            left_b.remove(matches[0])
    return pairs, left_a, left_b


def compared_instructions(sass: str) -> list[str]:
    """The instructions of a ``cuobjdump -sass`` listing that :data:`COMPARED` selects, whitespace normalized."""
    out = []
    for line in sass.splitlines():
        m = SASS_LINE.match(line)
        if m:
            ins = re.sub(r"\s+", " ", m.group(1))
            if COMPARED.match(GUARD.sub("", ins)) and not CONSTANT_MOVE.match(GUARD.sub("", ins)):
                out.append(ins)
    return out


def _renamed(ins: str) -> str:
    """Registers, guard predicates and operand-reuse hints (a scheduling detail) renamed away."""
    return re.sub(r"\bU?R\d+\b", "R", re.sub(r"\bU?P\d\b", "P", GUARD.sub("", ins))).replace(".reuse", "")


def classify(a: list[str], b: list[str]) -> str:
    """identical / renamed / rescheduled / different (see the module docstring)."""
    if a == b:
        return "identical"
    ra, rb = [_renamed(x) for x in a], [_renamed(x) for x in b]
    if ra == rb:
        return "renamed"
    if collections.Counter(ra) == collections.Counter(rb):
        return "rescheduled"
    return "different"


# ---- wheels and cubins ------------------------------------------------------------------------------------

def cuobjdump() -> str:
    candidates = [os.path.join(os.environ[v], "bin", "cuobjdump") for v in ("CUDA_HOME", "CUDA_PATH")
                  if os.environ.get(v)]
    candidates.append(shutil.which("cuobjdump") or "")
    for entry in sys.path:
        candidates += glob.glob(os.path.join(entry, "nvidia", "cu1*", "bin", "cuobjdump"))
        candidates += glob.glob(os.path.join(entry, "nvidia", "cuda_cuobjdump", "bin", "cuobjdump"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise SystemExit("cuobjdump not found: set CUDA_HOME, put it on PATH or pip install nvidia-cuda-cuobjdump")


DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


def parse_release(spec: str) -> tuple[str, str]:
    version, _, platform = spec.partition(":")
    return version, platform or DEFAULT_PLATFORM


def release_folder(work: pathlib.Path, spec: str) -> pathlib.Path:
    version, platform = parse_release(spec)
    return work / f"{version}-{platform}"


def fetch_release(spec: str, work: pathlib.Path, tool: str) -> dict:
    """Download the wheel (once), extract libtorch_cuda.so's cubins of ARCHS; returns the release's facts."""
    version, platform = parse_release(spec)
    folder = release_folder(work, spec)
    elf = folder / "elf"
    downloads = work / f"wheels-{platform}"
    wheels = glob.glob(str(downloads / f"torch-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
                        platform, "--python-version", "3.12", f"torch=={version}", "-d", str(downloads), "-q"],
                       check=True)
        wheels = glob.glob(str(downloads / f"torch-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        facts = dict(re.findall(r"^(__version__|git_version|cuda)(?:: Optional\[str\])? = '([^']*)'",
                                wheel.read("torch/version.py").decode(), re.M))
        if not elf.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                library = wheel.extract("torch/lib/libtorch_cuda.so", tmp)
                staging = pathlib.Path(tmp) / "elf"
                staging.mkdir()
                subprocess.run([tool, "-xelf", "all", library], cwd=staging, check=True, capture_output=True)
                for cubin in staging.iterdir():
                    if not any(cubin.name.endswith(f".{arch}.cubin") for arch in ARCHS):
                        cubin.unlink()
                staging.rename(elf)  # complete or absent: a crash leaves no half-extracted folder behind
    facts["wheel"] = os.path.basename(wheels[0])
    return facts


def instantiations(elf: pathlib.Path, arch: str, keys: tuple) -> dict[str, tuple[pathlib.Path, str]]:
    """normalized name -> (cubin, mangled name) of every same-dtype instantiation containing all ``keys``."""
    found = {}
    first = keys[0].encode()
    for cubin in sorted(elf.glob(f"*.{arch}.cubin")):
        data = cubin.read_bytes()
        if first not in data:
            continue
        for raw in set(re.findall(rb"_Z[A-Za-z0-9_]+", data)):
            name = raw.decode()
            if all(k in name for k in keys) and not CASTING.search(name):
                found[normalized_name(name)] = (cubin, name)
    return found


def sass_of(tool: str, cubin: pathlib.Path, name: str) -> str:
    return subprocess.run([tool, "-sass", "-fun", name, str(cubin)], check=True, capture_output=True, text=True).stdout


def compare(old: str, new: str, work: pathlib.Path, tool: str) -> dict:
    table = {}
    ok = True
    for kernel, keys in KERNELS.items():
        table[kernel] = {}
        for arch in ARCHS:
            a = instantiations(release_folder(work, old) / "elf", arch, keys)
            b = instantiations(release_folder(work, new) / "elf", arch, keys)
            verdicts = collections.Counter()
            flagged = []
            pairs, only_a, only_b = paired(a, b)
            for name_a, name_b in pairs:
                verdict = classify(compared_instructions(sass_of(tool, *a[name_a])),
                                   compared_instructions(sass_of(tool, *b[name_b])))
                verdicts[verdict] += 1
                if verdict == "different":
                    flagged.append({"instantiation": name_b, "old_instantiation": name_a})
            entry = {"compared": sum(verdicts.values()), **{v: verdicts[v] for v in VERDICTS},
                     "flagged": flagged, "paired_by_signature": [b_ for a_, b_ in pairs if a_ != b_],
                     f"only_in_{old}": only_a, f"only_in_{new}": only_b}
            table[kernel][arch] = entry
            ok &= entry["compared"] > 0 and not flagged
    return {"ok": ok, "kernels": table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="VERSION[:PLATFORM] already checked, e.g. 2.14.1")
    parser.add_argument("new", help="VERSION[:PLATFORM] to check, e.g. 2.15.0 or 2.15.0:manylinux_2_28_aarch64")
    parser.add_argument("--work", default=None, help="scratch folder kept between runs (default: a temporary one)")
    parser.add_argument("--out", default=None, help="write the comparison as JSON")
    args = parser.parse_args()
    tool = cuobjdump()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="torch-release-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if parse_release(args.old) == parse_release(args.new):
        parser.error("OLD and NEW name the same wheel")
    releases = {spec: fetch_release(spec, work, tool) for spec in (args.old, args.new)}
    tool_version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    result = {"command": f"python scripts/check_torch_release.py {args.old} {args.new}",
              "cuobjdump": " ".join(tool_version),
              "releases": releases, "archs": list(ARCHS), **compare(args.old, args.new, work, tool)}
    print(f"{'kernel':10} {'arch':7} {'compared':>8} {'identical':>9} {'renamed':>7} {'rescheduled':>11} "
          f"{'different':>9}  unpaired")
    for kernel, per_arch in result["kernels"].items():
        for arch, e in per_arch.items():
            missing = len(e[f"only_in_{args.old}"]) + len(e[f"only_in_{args.new}"])
            print(f"{kernel:10} {arch:7} {e['compared']:8} {e['identical']:9} {e['renamed']:7} "
                  f"{e['rescheduled']:11} {e['different']:9}  {missing}")
    print(f"{args.old} -> {args.new}: " + ("the same instructions in every compared instantiation" if result["ok"]
                                          else "READ THE FLAGGED INSTANTIATIONS (\"flagged\" in the JSON)"))
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")
        os.replace(tmp, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
