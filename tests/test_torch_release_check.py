"""scripts/check_torch_release.py (CPU): how it names, selects and compares torch's kernel instantiations. The
listings are shaped like cuobjdump's, with instructions taken from the torch 2.14.1 / 2.15.0 comparison
(scripts/torch-kernels/torch-kernels-2.14.1-vs-2.15.0.json)."""

import importlib.util
import pathlib
import stat
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_torch_release",
                                                  REPO_ROOT / "scripts" / "check_torch_release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listing(*instructions):
    """cuobjdump -sass lines: address comment, instruction, encoding comment."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;  /* 0x000fe200078e00ff */"
                     for i, ins in enumerate(instructions)) + "\n"


def test_names_lose_only_the_anonymous_namespace_hash(check):
    old = ("_ZN2at6native29vectorized_elementwise_kernelILi8EZZZNS0_62_GLOBAL__N__e7db5ad4_23_ActivationSiluKernel_cu_"
           "977e8e6d_4156711silu_kernelE")
    new = ("_ZN2at6native29vectorized_elementwise_kernelILi8EZZZNS0_62_GLOBAL__N__e7db5ad4_23_ActivationSiluKernel_cu_"
           "e5d96c45_4333911silu_kernelE")
    other = old.replace("ILi8E", "ILi4E")
    assert check.normalized_name(old) == check.normalized_name(new)
    assert check.normalized_name(old) != check.normalized_name(other)
    assert "silu_kernel" in check.normalized_name(old)


def test_only_instructions_that_decide_bits_are_compared(check):
    sass = listing("IMAD.U32 R2, R4, 0x10000, RZ", "FFMA R3, R2, R2, R3", "@!P0 STS.64 [R9], R2", "BRA 0x120",
                   "SHFL.DOWN PT, R3, R2, 0x8, 0x1f", "LDG.E.64 R4, desc[UR4][R6.64]", "MUFU.RSQ R5, R3",
                   "F2FP.BF16.F32.PACK_AB R5, RZ, R5", "BAR.SYNC.DEFER_BLOCKING 0x0")
    assert check.compared_instructions(sass) == [
        "FFMA R3, R2, R2, R3", "@!P0 STS.64 [R9], R2", "SHFL.DOWN PT, R3, R2, 0x8, 0x1f", "MUFU.RSQ R5, R3",
        "F2FP.BF16.F32.PACK_AB R5, RZ, R5", "BAR.SYNC.DEFER_BLOCKING 0x0"]


def test_classification(check):
    base = ["FSETP.NEU.AND P0, PT, R14, 1, PT", "FFMA R12, R13.reuse, R2.reuse, R0", "FMUL R13, R13, R2",
            "@P0 FFMA R12, R13, R14, R0", "F2FP.BF16.F32.PACK_AB R12, RZ, R12"]
    assert check.classify(base, list(base)) == "identical"
    # other registers, a guard turned into a branch around the instruction, no reuse hints
    renamed = ["FSETP.NEU.AND P1, PT, R15, 1, PT", "FFMA R10, R11, R3, R1", "FMUL R11, R11, R3",
               "FFMA R10, R11, R15, R1", "F2FP.BF16.F32.PACK_AB R10, RZ, R10"]
    assert check.classify(base, renamed) == "renamed"
    assert check.classify(base, base[1:3][::-1] + base[:1] + base[3:]) == "rescheduled"
    assert check.classify(base, base[1:]) == "different"  # a compare fewer (2.15.0's addcmul shares one)
    assert check.classify(base, [b.replace(", 1, PT", ", 2, PT") for b in base]) == "different"
    assert check.classify(base, [b.replace("FMUL", "FADD") for b in base]) == "different"


def fake_release(root: pathlib.Path, name: str, kernels: dict):
    """A release folder whose sm_90 cubin holds ``kernels`` (mangled name -> instructions) as a fake cuobjdump
    reads them back."""
    elf = root / name / "elf"
    elf.mkdir(parents=True)
    for arch in ("sm_90", "sm_100", "sm_120"):
        (elf / f"libtorch_cuda.1.{arch}.cubin").write_bytes(b"\0".join(n.encode() for n in kernels) + b"\0")
        for n, body in kernels.items():
            (root / name / f"{arch}.{n}.sass").write_text(listing(*body))


@pytest.fixture()
def fake_cuobjdump(tmp_path):
    tool = tmp_path / "cuobjdump"
    # -sass -fun NAME CUBIN: print <release>/<arch>.<NAME>.sass
    tool.write_text(f"#!{sys.executable}\nimport pathlib, sys\n"
                    "name, cubin = sys.argv[3], pathlib.Path(sys.argv[4])\n"
                    "arch = cubin.name.split('.')[-2]\n"
                    "print((cubin.parents[1] / f'{arch}.{name}.sass').read_text())\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(tool)


def test_compare_flags_changed_arithmetic_and_missing_kernels(check, tmp_path, fake_cuobjdump, monkeypatch):
    monkeypatch.setattr(check, "KERNELS", {"rms_norm": ("layer_normIbf16",), "mul": ("MulFunctor",)})
    rms = ["FFMA R3, R2, R2, R3", "SHFL.DOWN PT, R3, R2, 0x8, 0x1f", "FADD R3, R3, R4", "MUFU.RSQ R5, R3"]
    mul = ["FMUL R2, R3, R4", "F2FP.BF16.F32.PACK_AB R2, RZ, R2", "FMUL R5, R6, R7"]
    old = {"_Z10layer_normIbf16E": rms, "_Z3vecMulFunctorSt5arrayEEEviT0_": mul,
           "_Z3vecMulFunctorLoadWithCastE": ["FADD R1, R1, R1"]}
    fake_release(tmp_path, "2.0.0-" + check.DEFAULT_PLATFORM, old)
    # mul rescheduled and given a template flag with a false default, the casting variant changed (never compared),
    # a new instantiation with no partner, rms the same with other registers
    new = {"_Z10layer_normIbf16E": [r.replace("R3", "R9") for r in rms],
           "_Z3vecMulFunctorSt5arrayELb0EEEviT0_": mul[2:] + mul[:2],
           "_Z3vecMulFunctorSt5arrayELb1EEEviT0_": mul[:1], "_Z3vecMulFunctorLoadWithCastE": ["FMUL R1, R1, R1"]}
    fake_release(tmp_path, "2.1.0-" + check.DEFAULT_PLATFORM, new)
    result = check.compare("2.0.0", "2.1.0", tmp_path, fake_cuobjdump)
    assert result["ok"]
    mul_90 = result["kernels"]["mul"]["sm_90"]
    assert (mul_90["compared"], mul_90["rescheduled"]) == (1, 1)
    assert mul_90["paired_by_signature"] == ["_Z3vecMulFunctorSt5arrayELb0EEEviT0_"]
    assert mul_90["only_in_2.1.0"] == ["_Z3vecMulFunctorSt5arrayELb1EEEviT0_"]
    assert result["kernels"]["rms_norm"]["sm_100"]["renamed"] == 1

    # another rounding in the reduction, or a kernel gone, is flagged
    changed = {"_Z10layer_normIbf16E": [r.replace("FADD", "FADD.RZ") for r in rms],
               "_Z3vecMulFunctorSt5arrayEEEviT0_": mul}
    fake_release(tmp_path, "2.2.0-" + check.DEFAULT_PLATFORM, changed)
    result = check.compare("2.0.0", "2.2.0", tmp_path, fake_cuobjdump)
    assert not result["ok"]
    assert result["kernels"]["rms_norm"]["sm_120"]["flagged"] == [
        {"instantiation": "_Z10layer_normIbf16E", "old_instantiation": "_Z10layer_normIbf16E"}]
    fake_release(tmp_path, "2.3.0-" + check.DEFAULT_PLATFORM, {"_Z3vecMulFunctorSt5arrayEEEviT0_": mul})
    result = check.compare("2.0.0", "2.3.0", tmp_path, fake_cuobjdump)
    assert not result["ok"] and result["kernels"]["rms_norm"]["sm_90"]["only_in_2.0.0"] == ["_Z10layer_normIbf16E"]


def test_release_specs(check):
    assert check.parse_release("2.15.0") == ("2.15.0", "manylinux_2_28_x86_64")
    assert check.parse_release("2.15.0:manylinux_2_28_aarch64") == ("2.15.0", "manylinux_2_28_aarch64")
