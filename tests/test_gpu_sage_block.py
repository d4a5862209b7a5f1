"""ComfyUI's real H3 DiTBlock with ComfyUI's SageAttention 2 backend (``--use-sage-attention``), stock vs fused.

The backend is selected the way ComfyUI selects it: ``comfy/ldm/modules/attention.py`` binds
``optimized_attention = attention_sage`` at import when ``args.use_sage_attention`` is set, and
``comfy/ldm/minimax/model.py`` imports that name (``from comfy.ldm.modules.attention import optimized_attention``);
here ``args.use_sage_attention`` is set and both module names are bound to ``attention_sage`` before the fused
patches are built (``FusedAttention`` reads the block module's ``optimized_attention`` then). ``sageattention``
must have been importable when ComfyUI was imported (``attention.sageattn``): ``STEPS=sage`` in
benchmarks/gpu_run.sh builds it and puts it on PYTHONPATH first.

Stock calls ``attention_sage`` with head-major ``[1, H, S, D]`` views (``skip_reshape=True``): SageAttention's HND
path, then ComfyUI copies the output back to token-major (``out.transpose(1, 2).reshape(...)``). The fused block
calls it with token-major ``[1, S, H*D]`` views (``skip_reshape=False``): the NHD path, whose output is out_proj's
input as is. Layout copies are looked for in the kernels ComfyUI and the block launch around the ``sageattn``
call: from the RMSNorm + RoPE kernel to ``sageattn``'s first kernel, and from its last kernel to the return of
ComfyUI's attention function (one-cycle spin kernels mark both ends of each). Kernels inside ``sageattn`` (its V
padding ``torch.cat`` and FP8 transpose, in both arms) are SageAttention's own and listed separately.

Full width (H3_FULL, 37,296 + 414 + 100 = 37,810 tokens), NVFP4 compute forced on (below sm_100 both arms emulate
the FP4 GEMM the same way), both arms warmed first. JSON: ``$SAGE_BLOCK_JSON``, else ``$OUT/sage-block.json``,
else benchmarks/out/sage-block.json. The CPU tests check the same code at a tiny width with a stand-in ``sageattn``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import statistics

import pytest
import torch
from conftest import REPO_ROOT, requires_cuda
from parity import differing, fresh_seed
from test_h3_block_cpu import fused, run_blocks

from h3_fused_nvfp4.tools import synthetic as syn
from h3_fused_nvfp4.tools.report import MARKER, categorize, device_info, kernel_profile, time_ms

pytestmark = pytest.mark.usefixtures("comfyui")

COPY_NAME_HINTS = ("copy", "transpose", "contiguous", "catarray", "memcpy")
ROPE_CATEGORIES = ("rms_rope", "fused_rms_rope")
TIMING_REPS = 7


def sage_unavailable_reason() -> str | None:
    """None when SageAttention imports with the kernels this GPU's ``sageattn`` dispatch needs."""
    try:
        import sageattention  # noqa: F401
        from sageattention import core
    except Exception as exc:  # ImportError, or a built extension that does not load
        return (f"sageattention is not importable ({type(exc).__name__}: {exc}); STEPS=sage in "
                "benchmarks/gpu_run.sh builds it from .third_party/SageAttention")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        needed = {(9, 0): "SM90_ENABLED", (8, 0): "SM80_ENABLED"}.get((major, minor), "SM89_ENABLED")
        if not getattr(core, needed, False):
            return (f"sageattention imports but its extension for sm_{major}{minor} is missing "
                    f"(sageattention.core.{needed} is False)")
    return None


def requires_sage(fn):
    return pytest.mark.skipif(sage_unavailable_reason() is not None,
                              reason=f"needs SageAttention: {sage_unavailable_reason()}")(fn)


# ---- the backend, selected as ComfyUI selects it, and a probe around sageattn --------------------------------

@dataclasses.dataclass
class SageProbe:
    """Counts ``sageattn`` calls (ComfyUI's ``attention_sage`` falls back to PyTorch attention silently when it
    raises) and, while ``markers`` is on, brackets each call with spin kernels."""

    real: object
    calls: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    markers: bool = False

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs.get("tensor_layout"))
        if self.markers:
            torch.cuda._sleep(1)
        try:
            return self.real(q, k, v, **kwargs)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self.markers:
                torch.cuda._sleep(1)


@contextlib.contextmanager
def sage_selected(sageattn=None):
    """``--use-sage-attention`` in this process: ComfyUI's flag set and ``attention_sage`` bound where ComfyUI's
    import-time selection binds it. ``sageattn``: a stand-in (CPU tests); default ComfyUI's own import of it."""
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention
    import comfy.model_management as mm
    from comfy.cli_args import args

    real = sageattn or getattr(attention, "sageattn", None)
    if real is None:
        pytest.fail("ComfyUI's attention module was imported without sageattention (attention.sageattn missing, "
                    f"SAGE_ATTENTION_IS_AVAILABLE={attention.SAGE_ATTENTION_IS_AVAILABLE}): put the SageAttention "
                    "build on PYTHONPATH before the tests start")
    probe = SageProbe(real)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(args, "use_sage_attention", True)
        assert mm.sage_attention_enabled()
        mp.setattr(attention, "sageattn", probe, raising=False)
        mp.setattr(attention, "optimized_attention", attention.attention_sage)
        mp.setattr(attention, "optimized_attention_masked", attention.attention_sage)
        mp.setattr(h3, "optimized_attention", attention.attention_sage)
        yield probe


@contextlib.contextmanager
def attention_markers(probe: SageProbe, fused_attention=None):
    """Spin kernels at the entry and return of ComfyUI's attention function (both arms) and around sageattn."""
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention

    def marked(*args, **kwargs):
        torch.cuda._sleep(1)
        out = attention.attention_sage(*args, **kwargs)
        torch.cuda._sleep(1)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(h3, "optimized_attention", marked)
        if fused_attention is not None:
            mp.setattr(fused_attention, "attention_function", marked)
        mp.setattr(probe, "markers", True)
        yield


def is_copy_kernel(name: str) -> bool:
    low = name.lower()
    return categorize(name) == "copy" or any(h in low for h in COPY_NAME_HINTS)


def attention_windows(names: list[str]) -> dict:
    """Split one block's kernel names at the four markers (attention entry, sageattn start, sageattn end,
    attention return): ``around`` = kernels from the last RMSNorm + RoPE kernel before the entry to sageattn's
    start, plus those from sageattn's end to the return; ``inside`` = sageattn's own."""
    marks = [i for i, n in enumerate(names) if MARKER in n]
    if len(marks) != 4:
        raise AssertionError(f"expected 4 {MARKER} markers around one attention call, found {len(marks)} in "
                             f"{len(names)} kernels: {names}")
    entry, start, end, ret = marks
    rope = [i for i in range(entry) if categorize(names[i]) in ROPE_CATEGORIES]
    if not rope:
        raise AssertionError(f"no RMSNorm + RoPE kernel before the attention call in: {names[:entry]}")
    around = names[rope[-1] + 1:entry] + names[entry + 1:start] + names[end + 1:ret]
    inside = names[start + 1:end]
    return {"around": around, "inside": inside, "around_copies": [n for n in around if is_copy_kernel(n)],
            "inside_copies": [n for n in inside if is_copy_kernel(n)]}


# ---- the check ---------------------------------------------------------------------------------------------

def json_path() -> pathlib.Path:
    if os.environ.get("SAGE_BLOCK_JSON"):
        return pathlib.Path(os.environ["SAGE_BLOCK_JSON"])
    return pathlib.Path(os.environ.get("OUT") or REPO_ROOT / "benchmarks" / "out") / "sage-block.json"


def sage_versions() -> dict:
    import importlib.metadata

    import sageattention

    try:
        version = importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        version = "source build (no package metadata)"
    return {"sageattention": version, "sageattention_path": str(pathlib.Path(sageattention.__file__).parent),
            "sageattention_source_commit": os.environ.get("SAGE_SOURCE_COMMIT", "unknown")}


def sage_block_check(dims, tokens, device, *, measure: bool, sageattn=None) -> dict:
    """Stock vs fused block with ComfyUI's sage backend: parity always; with ``measure`` (CUDA) the kernels around
    the sage call and the block times. Returns the result dict (nothing asserted here)."""
    seed = fresh_seed()
    block = syn.make_dit_block(dims, seed=seed, device=device)
    inputs = syn.make_block_inputs(dims, tokens, seed=seed + 1, device=device)
    result = {"seed": seed, "tokens": int(inputs[0].shape[0]), "dims": dims.label}
    with sage_selected(sageattn) as probe:
        import comfy.ldm.modules.attention as attention

        run_blocks([block], inputs)  # warm: the first stock call of a process differs on the emulated path
        stock = run_blocks([block], inputs)
        stock_layouts = list(probe.calls)
        with fused([block]) as patches:
            fused_attention = patches["blocks.0.attn.forward"]
            result["fused_attention_function_is_attention_sage"] = (
                fused_attention.attention_function is attention.attention_sage)
            first = run_blocks([block], inputs)
            out = run_blocks([block], inputs)
            fused_layouts = probe.calls[len(stock_layouts):]
            counts = dict(patches["blocks.0.forward"].counts)
            rope_calls = fused_attention.counts["rms_rope"]
            if measure:
                with attention_markers(probe, fused_attention):
                    fused_names = [k["kernel"] for k in kernel_profile(lambda: run_blocks([block], inputs))]
                fused_ms = time_ms(lambda: run_blocks([block], inputs), reps=TIMING_REPS, warmup=2)
        if measure:
            with attention_markers(probe):
                stock_names = [k["kernel"] for k in kernel_profile(lambda: run_blocks([block], inputs))]
            stock_ms = time_ms(lambda: run_blocks([block], inputs), reps=TIMING_REPS, warmup=2)
    result.update({
        "differing_elements": differing(out, stock),
        "differing_elements_first_fused_call": differing(first, stock),
        "sageattn_layouts": {"stock": sorted(set(stock_layouts)), "fused": sorted(set(fused_layouts))},
        "sageattn_calls": {"stock": len(stock_layouts), "fused": len(fused_layouts)},
        "sageattn_errors": probe.errors,
        "fused_block_counts": counts, "fused_rms_rope_calls": rope_calls,
    })
    if measure:
        arms = {"stock": attention_windows(stock_names), "fused": attention_windows(fused_names)}
        result["layout_copies_around_sageattn"] = {a: w["around_copies"] for a, w in arms.items()}
        result["kernels_around_sageattn"] = {a: w["around"] for a, w in arms.items()}
        result["sageattn_internal_kernels"] = {a: w["inside"] for a, w in arms.items()}
        result["sageattn_internal_copies"] = {a: w["inside_copies"] for a, w in arms.items()}
        result["block_ms"] = {"stock_median": statistics.median(stock_ms), "fused_median": statistics.median(fused_ms),
                              "stock": stock_ms, "fused": fused_ms, "reps": TIMING_REPS,
                              "how": "CUDA events, one block call on a fresh copy of x, spin kernel ahead of each"}
        result["speedup_block"] = result["block_ms"]["stock_median"] / result["block_ms"]["fused_median"]
    return result


def assert_sage_result(result: dict, *, measure: bool) -> None:
    label = f"seed {result['seed']}"
    assert not result["sageattn_errors"], (f"sageattn raised, so ComfyUI ran PyTorch attention instead: "
                                           f"{result['sageattn_errors']}")
    assert result["fused_attention_function_is_attention_sage"], "the fused block did not pick up attention_sage"
    assert result["sageattn_layouts"] == {"stock": ["HND"], "fused": ["NHD"]}, result["sageattn_layouts"]
    assert result["differing_elements"] == 0, f"{label}: {result['differing_elements']} elements differ"
    assert result["fused_block_counts"].get("fused", 0) >= 2, result["fused_block_counts"]
    if measure:
        copies = result["layout_copies_around_sageattn"]
        assert copies["fused"] == [], f"layout copies around the fused arm's sage call: {copies['fused']}"
        assert copies["stock"], ("the stock arm's output copy (out.transpose(1, 2).reshape) was not found: the "
                                 f"kernel windows are wrong: {result['kernels_around_sageattn']['stock']}")
        assert result["sageattn_internal_kernels"]["fused"], "no kernels inside sageattn: markers misplaced"


@requires_cuda
@requires_sage
def test_full_width_block_with_sage_attention_bit_identical_and_copy_free():
    device = torch.device("cuda")
    result = {"check": "one real ComfyUI H3 DiTBlock at full width, ComfyUI's sage backend, stock vs fused",
              "device": device_info(device), **sage_versions()}
    import comfy_kitchen  # noqa: F401

    from h3_fused_nvfp4.tools import comfy_env

    result["comfyui"] = comfy_env.comfyui_version()
    result.update(sage_block_check(syn.H3_FULL, syn.FULL_TOKENS, device, measure=True))
    path = json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsage block: {result['differing_elements']} differing; block {result['block_ms']['stock_median']:.2f} -> "
          f"{result['block_ms']['fused_median']:.2f} ms; copies around sageattn: stock "
          f"{len(result['layout_copies_around_sageattn']['stock'])}, fused "
          f"{len(result['layout_copies_around_sageattn']['fused'])}; JSON {path}")
    assert_sage_result(result, measure=True)


# ---- CPU checks of the same code (no SageAttention needed) ----------------------------------------------------

def stand_in_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    """SageAttention's calling convention, computed the same way for both layouts (fp32 on contiguous head-major
    copies), so only the layouts ComfyUI and the fused block pass can make the arms differ."""
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.contiguous().float() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale).to(torch.bfloat16)
    return out.transpose(1, 2).contiguous() if tensor_layout == "NHD" else out.contiguous()


def test_sage_selection_tiny_block_bit_identical_with_a_stand_in():
    result = sage_block_check(syn.H3_SMALL, (19, 46, 245), torch.device("cpu"), measure=False,
                              sageattn=stand_in_sageattn)
    assert_sage_result(result, measure=False)
    assert result["sageattn_calls"] == {"stock": 2, "fused": 2}


def test_sage_kernel_windows():
    copy = "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    names = ["fused_rms_rope_split_half", MARKER, MARKER, "quant_per_thread_int8", "CatArrayBatchedCopy",
             "TransposePadPermuteKernel", "qk_int8_sv_f8_attn", MARKER, MARKER, "nvfp4_absmax_plain"]
    w = attention_windows(names)
    assert w["around"] == [] and w["around_copies"] == []
    assert w["inside_copies"] == ["CatArrayBatchedCopy", "TransposePadPermuteKernel"]
    stock = ["rms_rope_split_half_kernel", MARKER, MARKER, "qk_int8_sv_f8_attn", MARKER, copy, MARKER, "AbsFunctor"]
    assert attention_windows(stock)["around_copies"] == [copy]
    with pytest.raises(AssertionError, match="expected 4"):
        attention_windows(names[:3])
    with pytest.raises(AssertionError, match="no RMSNorm"):
        attention_windows(names[1:])
