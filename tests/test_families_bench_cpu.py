"""benchmarks/families.py on the CPU: the tiny run end to end (ComfyUI's loader, the Patch node's clone, the first
fused forward compared, calls counted by the fused Linears and seen by the module hooks), and the parent's side of
the Nsight Compute attribution on a made-up ncu CSV with the kernel names the H200 runs (benchmarks/h200-report.json):
windows paired with the child's calls, each kernel's role, the floor, the full-depth scaling."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
from comfy_harness import requires_comfyui
from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "families.py"
SELFCHECK_ENV = "H3_FUSED_NVFP4_SELFCHECK"


@requires_comfyui
def test_tiny_run_three_families_bit_identical_and_fully_fused(tmp_path):
    """Z-Image and FLUX.2 compute in bf16, Wan in fp16 (ComfyUI's choice for it): every call fused in each; Z-Image's
    and Wan's blocks fused whole (their blocks call their Linears themselves, so the module hooks see none of those),
    the first forward running the block check."""
    out = tmp_path / "families-tiny.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--families", "z_image,flux2_klein,wan22_14b",
                           "--reps", "1", "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and list(result["families"]) == ["z_image", "flux2_klein", "wan22_14b"]
    assert "no" in result["settings"]["ncu"] and "tiny" in result["settings"]["width"]
    assert result["settings"]["stock_arm_gemm"] is None  # said on GPUs without FP4 tensor cores only
    for name, section in result["families"].items():
        assert section["parity"]["total_differing_elements"] == 0, (name, section["parity"])
        assert section["parity"]["first_fused_forward_included"]
        calls = section["calls"]
        assert calls["fused_share"] == 1.0 and calls["stock"] == 0 and calls["nvfp4_linear_calls"] > 0, calls
        assert calls["same_in_every_compared_forward"], calls
        if name == "z_image":  # 2 layers + 2 noise-refiner + 2 context-refiner blocks, 5 NVFP4 Linears each
            assert calls["nvfp4_linear_calls"] == 30 and calls["hooked_module_calls"] == 0, calls
            assert "second fused forward" in calls["measured_forward"], calls
            assert section["block_fusion"]["last_compared_forward"] == {
                "fused": 6, "attention_norm1": 6, "ffn_norm1": 6, "residual": 12, "handoff_in": 3, "handoff_out": 3,
                "shared_packs": 6}, section["block_fusion"]
        elif section["patch"]["block_fusion"]:  # Wan's blocks call their fused Linears themselves
            assert not calls["every_call_seen_by_the_module_hooks"], calls
        else:
            assert calls["every_call_seen_by_the_module_hooks"] and "block_fusion" not in section, calls
        assert section["patch"]["fused_linears"] == section["patch"]["nvfp4_linears"] > 0
        assert section["dtype"] == ("float16" if name == "wan22_14b" else "bfloat16"), (name, section["dtype"])
        assert section["dtype_choice"] == "ComfyUI's choice"
        assert [f["label"] for f in section["fused"]["forwards"]] == ["first", "compared", "timed"]
    assert str(REPO_ROOT) not in out.read_text() and str(tmp_path) not in out.read_text()
    assert proc.stdout.strip().splitlines()[-1].startswith("wan22_14b")  # the table comes last


# ---- the ncu attribution, on a made-up profile -----------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    """benchmarks/families.py imported as a module (it sets the self-check env for its own runs: put back)."""
    before = os.environ.get(SELFCHECK_ENV)
    spec = importlib.util.spec_from_file_location("families_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if before is None:
        os.environ.pop(SELFCHECK_ENV, None)
    else:
        os.environ[SELFCHECK_ENV] = before
    return module


M, K = 4096, 3072  # double_blocks.0.img_attn.qkv at 1024x1024
M2, K2 = 4352, 12288  # single_blocks.1.linear2
SPIN = "spin_kernel(long)"
X = M * K * 2


def scales(rows, width):
    return -(-rows // 128) * 128 * (-(-(width // 16) // 4) * 4)


def stock_linear(rows, width):
    x, codes = rows * width * 2, rows * width // 2
    return [("void native::vectorized_elementwise_kernel<8, native::AbsFunctor<c10::BFloat16>>", x, x),
            ("void native::reduce_kernel<512, 1, native::ReduceOp<c10::BFloat16, MaxNanFunctor>>", x, 0),
            ("void native::vectorized_elementwise_kernel<8, native::BUnaryFunctor<c10::BFloat16, MulFunctor>>", 0, 0),
            ("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", 0, 0),
            ("void native::vectorized_elementwise_kernel<4, native::FillFunctor<unsigned char>>", 0, codes),
            ("void comfy::<unnamed>::quantize_nvfp4_kernel<__nv_bfloat16, __nv_fp4x2_e2m1>", x, codes),
            ("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", 1000, 1000),  # weight cast
            ("void native::vectorized_elementwise_kernel<4, native::BinaryFunctor<float, float, float>>", 0, 0),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", codes, x),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", 10**6, 4 * 10**6),
            ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", x, x)]


def fused_linear(rows, width):
    x, codes = rows * width * 2, rows * width // 2
    return [("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", 500, 500),  # weight cast
            ("nvfp4_absmax_plain", x, 0), ("nvfp4_pack_plain", x, codes + scales(rows, width)),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", codes, x),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", 10**6, 4 * 10**6),
            ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", x, x)]


def ncu_csv(kernels) -> str:
    """Nsight Compute's --csv output for (name, read bytes, written bytes) kernels, one row per metric."""
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, (name, read, write) in enumerate(kernels):
        for metric, unit, value in (("dram__bytes_read.sum", "byte", read), ("dram__bytes_write.sum", "byte", write),
                                    ("gpu__time_duration.sum", "usecond", 10)):
            lines.append(f'"{i}","{name}","{metric}","{unit}","{value:,}"')
    return "==PROF== Connected\n" + "\n".join(lines) + "\n"


def call(layer, rows, width, path):
    return {"layer": layer, "rows": rows, "width": width, "element_bytes": 2, "dtype": "bfloat16",
            "static_scale": False, "path": path}


@requires_comfyui
def test_ncu_windows_attributed_to_linear_input_path_and_rest(bench, comfyui, monkeypatch):
    layers = [("double_blocks.0.img_attn.qkv", M, K), ("single_blocks.1.linear2", M2, K2)]
    stock_forward = [(SPIN, 0, 0), ("void native::vectorized_layer_norm_kernel<c10::BFloat16, float>", X, X),
                     ("void native::elementwise_kernel<128, 4, native::BinaryFunctor<c10::BFloat16, MulFunctor>>",
                      X, X)]
    for i, (_, rows, width) in enumerate(layers):
        stock_forward += [(SPIN, 0, 0), *stock_linear(rows, width), (SPIN, 0, 0)]
        stock_forward += ([("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 3 * X, X),
                           ("void comfy::<unnamed>::rope_kernel<__nv_bfloat16>", 2 * X, 2 * X)] if i == 0 else
                          [("void native::vectorized_elementwise_kernel<4, native::GeluCUDAKernelImpl>", X, X),
                           ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_bias_TNT", 100, 100)])
    fused_windows = [k for _, rows, width in layers for k in [(SPIN, 0, 0), *fused_linear(rows, width)]]
    arms = [{"arm": "stock", "scope": "forward", "calls": [call(n, r, w, "stock") for n, r, w in layers]},
            {"arm": "fused", "scope": "linears", "calls": [call(n, r, w, "fused") for n, r, w in layers]}]

    def fake_run(cmd, **kwargs):
        sidecar = cmd[cmd.index("--ncu-child") + 1]
        with open(sidecar, "w") as f:
            json.dump({"family": "flux2_klein", "arms": arms}, f)
        return types.SimpleNamespace(returncode=0, stdout=ncu_csv(stock_forward + fused_windows), stderr="")

    monkeypatch.setattr(bench.rep.subprocess, "run", fake_run)
    args = bench.parse_args(["--families", "flux2_klein", "--layers", "2"])
    out = bench.dram_section("flux2_klein", args)
    assert "error" not in out, out

    stock, fused = out["stock"], out["fused"]
    floor = sum(2 * r * w * 2 + r * w // 2 + scales(r, w) for _, r, w in layers)
    assert stock["linear_input_path"]["launches"] == 2 * 7  # abs, amax, divide, cast, zero-fill, pack, alpha
    assert fused["linear_input_path"]["launches"] == 2 * 2
    assert stock["weight_cast"]["launches"] == fused["weight_cast"]["launches"] == 2
    assert stock["emulation_dequant"]["launches"] == fused["emulation_dequant"]["launches"] == 4
    assert stock["gemm"]["launches"] == fused["gemm"]["launches"] == 2
    assert fused["linear_input_path"]["floor_gb"] == round(floor / 1e9, 4)
    assert fused["linear_input_path"]["by_path"]["fused"]["bytes_over_floor"] == 1.0
    assert set(fused["linear_input_path"]["by_category"]) == {"fused_absmax", "fused_pack"}
    assert out["summary"]["fused_within_10pct_of_floor"] is True and "flag" not in out["summary"]
    assert stock["linear_input_path"]["dram_gb"] > fused["linear_input_path"]["dram_gb"]

    # Flux.2 [klein]: 5 double and 20 single blocks at full depth, 2 + 2 measured
    assert out["full_depth_scale"]["per_block_list"] == {"double_blocks": 2.5, "single_blocks": 10.0}
    per_call = [2 * r * w * 2 + r * w // 2 + scales(r, w) for _, r, w in layers]
    assert fused["linear_input_path"]["full_depth_gb"] == round((2.5 * per_call[0] + 10 * per_call[1]) / 1e9, 4)
    assert set(stock["per_layer_kind"]) == {"double_blocks.*.img_attn.qkv", "single_blocks.*.linear2"}

    rest = stock["rest_of_forward"]["by_category"]
    assert {c: v["launches"] for c, v in rest.items()} == {
        "norms": 1, "elementwise_mul_add_modulation": 1, "attention": 1, "rope": 1, "activation_functions": 1,
        "bf16_gemm": 1}
    assert stock["rest_of_forward"]["non_gemm_non_attention"]["launches"] == 4
    assert "rest_of_forward" not in fused


@requires_comfyui
def test_ncu_window_count_mismatch_is_reported_not_raised(bench, comfyui, monkeypatch):
    def fake_run(cmd, **kwargs):
        sidecar = cmd[cmd.index("--ncu-child") + 1]
        with open(sidecar, "w") as f:
            json.dump({"family": "z_image", "arms": [{"arm": "stock", "scope": "forward",
                                                      "calls": [call("layers.0.attention.qkv", 64, 3840, "stock")]}]},
                      f)
        return types.SimpleNamespace(returncode=0, stdout=ncu_csv([(SPIN, 0, 0), ("nvjet_x", 1, 1)]), stderr="")

    monkeypatch.setattr(bench.rep.subprocess, "run", fake_run)
    out = bench.dram_section("z_image", bench.parse_args(["--families", "z_image"]))
    assert "1 marker windows" in out["error"] and "3 expected" in out["error"], out


def test_floor_of_static_and_dynamic_scales(bench):
    dynamic = call("l", 300, 64, "fused")
    static = dict(dynamic, static_scale=True)
    codes, padded_scales = 300 * 64 // 2, 384 * 4
    assert bench.floor_bytes(dynamic) == 2 * 300 * 64 * 2 + codes + padded_scales
    assert bench.floor_bytes(static) == 300 * 64 * 2 + codes + padded_scales


def test_copy_ahead_of_the_pack_is_input_layout_or_weight_cast_by_what_it_reads(bench):
    def kernels(copy_read):
        return [{"kernel": n, "dram__bytes_read.sum": r} for n, r in (
            ("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", copy_read),
            ("nvfp4_absmax_plain", X), ("nvfp4_pack_plain", X),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", X // 4),
            ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", X),
            ("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", X))]

    tail = ["input_path", "input_path", "emulation_dequant", "gemm", "after_gemm"]
    assert bench.linear_window_roles(kernels(X), X) == ["input_path", *tail]
    assert bench.linear_window_roles(kernels(4096), X) == ["weight_cast", *tail]


class RecordingMarks:
    """Stands in for CudaMarks on the CPU: the sequence of marks the ncu child would make."""

    def __init__(self):
        self.events = []

    def marker(self, cycles=1):
        self.events.append("marker")

    def profiler_start(self):
        self.events.append("start")

    def profiler_stop(self):
        self.events.append("stop")

    def range_push(self, name):
        self.events.append("push")

    def range_pop(self):
        self.events.append("pop")


@requires_comfyui
def test_ncu_child_opens_the_windows_the_parent_expects(bench, force_nvfp4_compute, clean_models, tmp_path):
    """The child's marks, replayed the way ncu sees them (kernels between profiler start and stop, a window opened
    at each spin kernel), give the parent's window count; every marker lies inside a profiled range."""
    sidecar = tmp_path / "calls.json"
    args = bench.parse_args(["--tiny", "--families", "flux2_klein", "--ncu-child", str(sidecar)])
    marks = RecordingMarks()
    assert bench.ncu_child(args, bench.torch.device("cpu"), marks=marks) == 0
    arms = json.loads(sidecar.read_text())["arms"]
    assert [(a["arm"], a["scope"]) for a in arms] == [("stock", "forward"), ("fused", "linears")]
    stock_calls, fused_calls = (a["calls"] for a in arms)
    assert len(stock_calls) == len(fused_calls) == 20  # 2 double blocks x 8 + 2 single blocks x 2
    assert {c["path"] for c in stock_calls} == {"stock"} and {c["path"] for c in fused_calls} == {"fused"}
    profiling, windows = False, 0
    for event in marks.events:
        if event in ("start", "stop"):
            profiling = event == "start"
        elif event == "marker":
            assert profiling, "a marker outside the profiled ranges opens no window"
            windows += 1
    assert windows == bench.expected_windows(arms) == 1 + 2 * 20 + 20
    assert marks.events.count("push") == marks.events.count("pop") == 40


@requires_comfyui
def test_ncu_child_profiles_a_block_fusion_by_blocks(bench, force_nvfp4_compute, clean_models, tmp_path):
    """Z-Image's fused blocks call their Linears themselves: the child profiles the stock forward by its Linears,
    then both arms by blocks (a marker before and after each block call), each block call with its exact-fusion
    floor."""
    sidecar = tmp_path / "calls.json"
    args = bench.parse_args(["--tiny", "--families", "z_image", "--ncu-child", str(sidecar)])
    marks = RecordingMarks()
    with bench.fam.detection_reads_metadata():
        assert bench.ncu_child(args, bench.torch.device("cpu"), marks=marks) == 0
    arms = json.loads(sidecar.read_text())["arms"]
    assert [(a["arm"], a["scope"]) for a in arms] == [("stock", "forward"), ("stock", "blocks"), ("fused", "blocks")]
    linear_calls, stock_blocks, fused_blocks = (a["calls"] for a in arms)
    assert len(linear_calls) == 30 and {c["path"] for c in linear_calls} == {"stock"}
    order = ["context_refiner.0", "context_refiner.1", "noise_refiner.0", "noise_refiner.1", "layers.0", "layers.1"]
    assert [c["block"] for c in stock_blocks] == [c["block"] for c in fused_blocks] == order
    assert all(c["floor_bytes"] > 0 and c["width"] == 256 for c in fused_blocks)
    assert stock_blocks == fused_blocks  # the same calls, floors included
    profiling, windows = False, 0
    for event in marks.events:
        if event in ("start", "stop"):
            profiling = event == "start"
        elif event == "marker":
            assert profiling, "a marker outside the profiled ranges opens no window"
            windows += 1
    assert windows == bench.expected_windows(arms) == (1 + 2 * 30) + 2 * (1 + 2 * 6)


# Z-Image at 1024x1024 (layers: 4352 rows of 3840): a made-up profile with the kernel names the H200 runs
ZR, ZD, ZF = 4352, 3840, 10240
ZA = ZR * ZD * 2
MB = 10**6


def _zimage_stock_block():
    """ComfyUI's block, shortened: its norms, modulation, gates, rope, attention, a Linear input path (abs, amax,
    pack) and the emulated GEMM."""
    return [("void native::vectorized_layer_norm_kernel<c10::BFloat16, float>", 0, 0),  # none in a lumina block
            ("void at::native::(anonymous namespace)::vectorized_rms_norm_kernel<c10::BFloat16>", ZA, ZA),
            ("void native::vectorized_elementwise_kernel<4, native::BinaryFunctor<c10::BFloat16, MulFunctor>>",
             ZA, ZA),
            ("void native::vectorized_elementwise_kernel<8, native::AbsFunctor<c10::BFloat16>>", ZA, ZA),
            ("void native::reduce_kernel<512, 1, native::ReduceOp<c10::BFloat16, MaxNanFunctor>>", ZA, 0),
            ("void comfy::<unnamed>::quantize_nvfp4_kernel<__nv_bfloat16, __nv_fp4x2_e2m1>", ZA, ZA // 4),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", ZA // 4, ZA),
            ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", ZA, 3 * ZA),
            ("void comfy::<unnamed>::rope_kernel<__nv_bfloat16>", 2 * ZA, 2 * ZA),
            ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 3 * ZA, ZA),
            ("void native::vectorized_elementwise_kernel<4, native::CUDAFunctor_add<c10::BFloat16>>", 2 * ZA, ZA)]


def _zimage_fused_block():
    return [("nvfp4_pack_norm_scale", ZA, ZA // 4),
            ("void comfy::<unnamed>::dequantize_nvfp4_kernel<__nv_fp4x2_e2m1, __nv_bfloat16>", ZA // 4, ZA),
            ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", ZA, 3 * ZA),
            ("void comfy::<unnamed>::rope_kernel<__nv_bfloat16>", 2 * ZA, 2 * ZA),
            ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 3 * ZA, ZA),
            ("nvfp4_absmax_plain", ZA, 0),
            ("fused_post_norm_residual_gated_amax_scale", 2 * ZA, ZA),
            ("void native::vectorized_elementwise_kernel<4, native::BinaryFunctor<float, float, float>>", 0, 0),
            ("fused_post_norm_residual_gated_stats", 2 * ZA, ZA)]


OUTSIDE = [("void native::vectorized_elementwise_kernel<2, native::cos_kernel_cuda>", MB, MB),
           ("void native::unrolled_elementwise_kernel<native::direct_copy_kernel_cuda>", ZA, ZA)]


def block_call(name, floor):
    return {"block": name, "rows": ZR, "tokens": ZR, "width": ZD, "floor_bytes": floor}


@requires_comfyui
def test_block_profiles_give_the_whole_forward_by_category_against_the_floor(bench, comfyui, monkeypatch):
    """The parent's side for a block fusion: the stock forward by its Linears (input path + rest), both arms by
    blocks: non-GEMM non-attention bytes and launches by category (absmax, packs, residual / norm kernels, rope,
    copies...), the input path and the rest, inside and outside the blocks, the fused blocks over their exact-fusion
    floor, full depth (the layers x 15 for 2 of 30), the GB10 projection per forward and per 8-step image, and the
    README table's row."""
    blocks = ["layers.0", "layers.1"]
    floor = 10 * ZA
    stock_linear_windows = [[(SPIN, 0, 0), *stock_linear(ZR, ZD)] for _ in range(2)]
    stock_forward = [(SPIN, 0, 0), *OUTSIDE, *stock_linear_windows[0], (SPIN, 0, 0), *_zimage_stock_block()[:3],
                     *stock_linear_windows[1], (SPIN, 0, 0), *OUTSIDE]
    by_blocks = {arm: [(SPIN, 0, 0), *OUTSIDE] + [k for _ in blocks for k in [(SPIN, 0, 0), *kernels, (SPIN, 0, 0)]]
                 for arm, kernels in (("stock", _zimage_stock_block()), ("fused", _zimage_fused_block()))}
    linear_calls = [call("layers.0.attention.qkv", ZR, ZD, "stock"), call("layers.1.attention.qkv", ZR, ZD, "stock")]
    arms = [{"arm": "stock", "scope": "forward", "calls": linear_calls},
            {"arm": "stock", "scope": "blocks", "calls": [block_call(b, floor) for b in blocks]},
            {"arm": "fused", "scope": "blocks", "calls": [block_call(b, floor) for b in blocks]}]

    def fake_run(cmd, **kwargs):
        sidecar = cmd[cmd.index("--ncu-child") + 1]
        with open(sidecar, "w") as f:
            json.dump({"family": "z_image", "arms": arms}, f)
        return types.SimpleNamespace(returncode=0, stdout=ncu_csv(stock_forward + by_blocks["stock"]
                                                                  + by_blocks["fused"]), stderr="")

    monkeypatch.setattr(bench.rep.subprocess, "run", fake_run)
    out = bench.dram_section("z_image", bench.parse_args(["--families", "z_image", "--layers", "2"]))
    assert "error" not in out, out
    assert set(out) >= {"stock", "stock_blocks", "fused_blocks", "summary", "whole_forward"} and "fused" not in out

    fused = out["fused_blocks"]["non_gemm_non_attention"]
    gb = lambda n: round(n / 1e9, 4)  # noqa: E731
    per_block = {"packs": (ZA + ZA // 4, 1), "absmax": (ZA, 1), "residual_norm_kernels": (6 * ZA, 2),
                 "rope": (4 * ZA, 1), "scales_alpha": (0, 1)}
    outside = 2 * MB + 2 * ZA  # before the first block: the timestep embedding's cos, a layout copy
    assert {g: (v["dram_gb"], v["launches"]) for g, v in fused["by_category"].items()} == {
        **{g: (gb(2 * b), 2 * n) for g, (b, n) in per_block.items()},
        "other": (gb(2 * MB), 1), "copies_layout": (gb(2 * ZA), 1)}, fused["by_category"]
    assert fused["input_path"] == {"launches": 6, "dram_gb": gb(2 * (2 * ZA + ZA // 4)), "ncu_ms": 0.06}
    assert fused["inside_blocks"]["dram_gb"] == gb(2 * (ZA + ZA // 4 + ZA + 6 * ZA + 4 * ZA))
    assert fused["outside_blocks"]["dram_gb"] == gb(outside)
    inside = 2 * (12 * ZA + ZA // 4)
    assert out["fused_blocks"]["blocks_floor"] == {"floor_gb": gb(2 * floor), "inside_blocks_gb": gb(inside),
                                                   "inside_blocks_over_floor": round(inside / (2 * floor), 4)}
    assert fused["per_block_list"] == {"layers": {"calls": 2, "rows_per_call": ZR, "launches": 12,
                                                  "dram_gb": gb(inside), "floor_gb": gb(2 * floor)}}
    assert fused["full_depth_gb"] == gb(outside + 15 * inside)  # 30 of 30 layers from 2
    excluded = out["fused_blocks"]["excluded"]
    assert excluded["nvfp4_gemm"]["launches"] == 4 and excluded["attention"]["launches"] == 2

    whole = out["whole_forward"]
    stock = out["stock"]
    assert whole["stock"]["input_path"] == {k: stock["linear_input_path"][k] for k in ("launches", "dram_gb")}
    assert whole["stock"]["input_path"]["launches"] == 14  # 7 per stock Linear call
    assert whole["stock"]["total"]["dram_gb"] == round(
        stock["linear_input_path"]["dram_gb"] + stock["rest_of_forward"]["non_gemm_non_attention"]["dram_gb"], 4)
    assert whole["fused"]["total"] == {"launches": fused["launches"], "dram_gb": fused["dram_gb"]}
    assert whole["fused_over_stock"] == round(fused["dram_gb"] / whole["stock"]["total"]["dram_gb"], 4)
    assert whole["blocks_exact_fusion_floor"]["within_10pct"] is False  # 1.23x: flagged
    assert whole["stock_by_blocks_total"]["launches"] == out["stock_blocks"]["non_gemm_non_attention"]["launches"]
    gb10 = whole["gb10_at_232_gbs"]
    assert gb10["per_forward_ms"]["fused"] == round(fused["dram_gb"] / 232 * 1e3, 3)
    assert gb10["per_8_step_image_s"]["fused"] == round(gb10["per_forward_ms"]["fused"] * 8 / 1e3, 3)
    assert gb10["full_depth_per_forward_ms"]["fused"] == round(fused["full_depth_gb"] / 232 * 1e3, 3)
    assert out["summary"]["linear_input_gb"]["fused"] == fused["input_path"]["dram_gb"]
    assert out["summary"]["fused_calls_bytes_over_floor"] is None and "note" in out["summary"]

    section = {"title": "Z-Image Turbo", "load": {"model_class": "NextDiT"}, "depth": "2 of 30 n_layers",
               "resolution_w_h_frames": [1024, 1024, 1], "dtype": "bfloat16",
               "parity": {"total_differing_elements": 0}, "calls": {"fused": 30, "nvfp4_linear_calls": 30},
               "dram": out}
    table = bench.readme_table([{"families": {"z_image": section}}])
    assert len(table) == 3 and table[2].startswith("| Z-Image Turbo (NextDiT) | 2 of 30 n_layers, 1024x1024, "
                                                   "bfloat16 | 0 differing | 30 of 30 | "), table
    assert f"-> **{fused['input_path']['dram_gb']:.2f} + {fused['rest']['dram_gb']:.2f} = " in table[2], table


@requires_comfyui
def test_blocks_only_profiles_split_the_stock_forward_by_kernel_name(bench, comfyui, monkeypatch):
    """``--ncu-blocks-only`` (full depth within ncu's time): the child profiles both arms by blocks only, and the
    stock forward's input path / rest split comes from kernel names (abs, amax, pack of ComfyUI's Linears)."""
    blocks = ["layers.0", "layers.1"]
    arms = [{"arm": arm, "scope": "blocks", "calls": [block_call(b, 10 * ZA) for b in blocks]}
            for arm in ("stock", "fused")]
    profile = [k for arm in ("stock", "fused") for k in [(SPIN, 0, 0), *OUTSIDE] + [
        k for _ in blocks for k in [(SPIN, 0, 0), *(_zimage_stock_block() if arm == "stock" else
                                                    _zimage_fused_block()), (SPIN, 0, 0)]]]

    def fake_run(cmd, **kwargs):
        assert "--ncu-blocks-only" in cmd
        with open(cmd[cmd.index("--ncu-child") + 1], "w") as f:
            json.dump({"family": "z_image", "arms": arms}, f)
        return types.SimpleNamespace(returncode=0, stdout=ncu_csv(profile), stderr="")

    monkeypatch.setattr(bench.rep.subprocess, "run", fake_run)
    out = bench.dram_section("z_image", bench.parse_args(["--families", "z_image", "--ncu-blocks-only"]))
    assert "error" not in out and "stock" not in out and "summary" not in out, out
    stock = out["whole_forward"]["stock"]
    assert stock["input_path"] == {"launches": 6, "dram_gb": round(2 * (2 * ZA + ZA + ZA + ZA // 4) / 1e9, 4)}
    assert "by kernel name" in stock["how"]
    assert stock["total"]["dram_gb"] == out["stock_blocks"]["non_gemm_non_attention"]["dram_gb"]
