"""Z-Image's family pieces on the CPU: the adaLN row of each token against ComfyUI's own lumina ``modulate`` /
``apply_gate`` (with and without timestep_zero_index, and the layouts it refuses), and the self-check probes of the
fused ops: bit-identical with the Python twin, and each one failing on a twin that rounds once where ComfyUI rounds
twice (or applies the wrong rows)."""

from __future__ import annotations

import pytest
import torch

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core import verdicts
from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.models.zimage import probes
from h3_fused_nvfp4.models.zimage.modulation import adaln_row_index

pytestmark = pytest.mark.usefixtures("comfyui")
CPU = torch.device("cpu")


def _comfy_rows(batch: int, tokens: int, table_rows: int, tzi) -> torch.Tensor:
    """The row ComfyUI's modulate applies to each token, read back from its arithmetic: table row r scales by r + 1."""
    m = comfy_adapter.lumina_model_module()
    scale = torch.arange(table_rows, dtype=torch.bfloat16)[:, None].expand(table_rows, 4).contiguous()
    x = torch.ones((batch, tokens, 4), dtype=torch.bfloat16)
    out = m.modulate(x, scale, timestep_zero_index=tzi)
    gated = m.apply_gate((scale + 1).unsqueeze(1), torch.ones_like(x), timestep_zero_index=tzi)
    assert torch.equal(out, gated)  # apply_gate picks the same rows
    return (out[..., 0].float() - 1).to(torch.int32).reshape(-1)


@pytest.mark.parametrize("batch,table_rows,tzi", [
    (1, 1, None), (2, 2, None), (3, 1, None), (1, 2, [(10, 20)]), (2, 4, [(30, 37), (3, 9)]), (2, 2, [(0, 5)]),
    (2, 4, [(5, 5), (30, 99)]), (2, 4, [(40, 50)]), (2, 4, []),
])
def test_row_index_is_comfyuis(batch, table_rows, tzi):
    """Slices clamped at the end (30, 99), empty ones, slices past the end and none at all, as Python slicing and
    invert_slices treat them."""
    expected = _comfy_rows(batch, 37, table_rows, tzi)
    assert torch.equal(adaln_row_index(batch, 37, table_rows, tzi), expected)


@pytest.mark.parametrize("batch,table_rows,tzi,message", [
    (2, 3, None, "do not broadcast"), (2, 3, [(0, 4)], "2 x 2"), (2, 6, [(0, 4)], "2 x 2"),
    (1, 2, [(0, 10), (5, 12)], "overlap"), (1, 2, [(3, 9), (3, 9)], "overlap"), (1, 2, [(-4, 9)], "forward range"),
    (1, 2, [(9, 3)], "forward range"),
])
def test_row_index_refuses_what_is_not_one_row_per_token(batch, table_rows, tzi, message):
    """Overlapping slices are multiplied twice by ComfyUI, reversed and negative bounds are Python slicing from the
    end: no single row per token, so the fused path refuses them (the block then runs ComfyUI's own)."""
    with pytest.raises(ValueError, match=message):
        adaln_row_index(batch, 37, table_rows, tzi)


def test_probes_pass_with_the_twin():
    results = verdicts.run_probes(twin_ops, CPU, (probes.ZIMAGE_PROBES,))
    assert set(results) == set(probes.ZIMAGE_PROBES.probes)
    assert all(r.ok is True for r in results.values()), {n: r.detail for n, r in results.items()}


def _one_rounding_scale(x, modulation):
    return (x.float() * (1.0 + twin_ops._rows(modulation.scale, modulation.mod_index).float())).to(torch.bfloat16)


def _post_norm_addcmul(x, other, other_weight, other_eps, gate, mod_index, **next_norm):
    n = torch.nn.functional.rms_norm(other, (other.shape[-1],), other_weight, other_eps)
    x.add_(n) if gate is None else x.addcmul_(twin_ops._rows(gate, mod_index), n)
    if next_norm.get("next_norm") is not None:
        twin_ops.norm_statistics(x, next_norm["next_norm"], modulation=next_norm.get("next_modulation"),
                                 global_scale_out=next_norm.get("global_scale_out"))
    return x


def _post_norm_unrounded(x, other, other_weight, other_eps, gate, mod_index, **next_norm):
    n = torch.nn.functional.rms_norm(other.float(), (other.shape[-1],), other_weight.float(), other_eps)
    x.copy_((x.float() + n).to(torch.bfloat16))
    if next_norm.get("next_norm") is not None:
        twin_ops.norm_statistics(x, next_norm["next_norm"], modulation=next_norm.get("next_modulation"),
                                 global_scale_out=next_norm.get("global_scale_out"))
    return x


_post_norm_residual = twin_ops.post_norm_residual_


def _post_norm_from_updating_its_input(x, other, other_weight, other_eps, gate, mod_index, x_from=None, **next_norm):
    """The out-of-place residual computed in the input, then copied: right output, changed input."""
    if x_from is None:
        return _post_norm_residual(x, other, other_weight, other_eps, gate, mod_index, **next_norm)
    _post_norm_residual(x_from, other, other_weight, other_eps, gate, mod_index, **next_norm)
    return x.copy_(x_from)


def _post_norm_from_ignored(x, other, other_weight, other_eps, gate, mod_index, x_from=None, **next_norm):
    """The out-of-place residual reading the stream it writes instead of its input."""
    return _post_norm_residual(x, other, other_weight, other_eps, gate, mod_index, **next_norm)


def _swiglu_one_rounding(y, up=None):
    return (torch.nn.functional.silu(y.float()) * up.float()).to(torch.bfloat16)


def _rms_norm_rounded_twice(x, norm):
    """The normalized value rounded to bf16 before the weight multiplies it (torch rounds once, after)."""
    normalized = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)
    return normalized * norm.weight


@pytest.mark.parametrize("probe,attribute,fault", [
    ("pack_norm_scale", "modulate", _one_rounding_scale),
    ("pack_norm_unmodulated", "rms_norm", _rms_norm_rounded_twice),
    ("post_norm_residual_gated", "post_norm_residual_", _post_norm_addcmul),
    ("post_norm_residual", "post_norm_residual_", _post_norm_unrounded),
    ("pack_swiglu_pair", "swiglu", _swiglu_one_rounding),
    ("post_norm_residual_gated", "post_norm_residual_", _post_norm_from_updating_its_input),
    ("post_norm_residual", "post_norm_residual_", _post_norm_from_updating_its_input),
    ("post_norm_residual_gated", "post_norm_residual_", _post_norm_from_ignored),
    ("post_norm_residual", "post_norm_residual_", _post_norm_from_ignored),
])
def test_each_probe_catches_a_wrong_twin(probe, attribute, fault, monkeypatch):
    monkeypatch.setattr(twin_ops, attribute, fault)
    detail = probes.ZIMAGE_PROBES.probes[probe](twin_ops, CPU)
    assert detail is not None and "differs at index" in detail, detail


def test_probe_source_hash_names_comfyuis_code():
    digest = probes.zimage_comfy_source()
    assert len(digest) == 16 and not digest.startswith("unavailable"), digest
