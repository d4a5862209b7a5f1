"""ComfyUI's real Z-Image ``JointTransformerBlock`` (comfy/ldm/lumina/model.py with ``comfy.ops.mixed_precision_ops``,
NVFP4 weights from ComfyUI's own quantizer) against the fused sequence of tests/zimage_block.py, on the CPU.

Off the GPU the fused ops are kernels/twin_ops.py, the Python twin of the kernels: these tests show that the fused
sequence (the normalized, scale-modulated packs with their statistics from the previous residual, the post-norm
residuals with the next norm's statistics and amax, one pack for w1 and w3, the SwiGLU of two tensors in w2's pack,
the hand-over between blocks) computes ComfyUI's block bit for bit: modulated and refiner blocks, batch 1 and 2,
timestep_zero_index, dynamic and static input scales. It is the specification the family's fused block meets.
"""

from __future__ import annotations

import pytest
from parity import assert_bit_identical, fresh_seed
from zimage_block import TINY, fused_blocks, make_block, make_inputs, stock_blocks

from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.models.zimage.probes import TIMESTEP_ZERO_INDEX

pytestmark = pytest.mark.usefixtures("comfyui")

TOKENS = 37  # B x 37 rows: not a multiple of 16 or 128
STATIC = {
    "dynamic": (),
    "static-mix": ("attention.qkv", "feed_forward.w2"),
    "w1-w3-differ": ("feed_forward.w1",),  # w1 static, w3 dynamic: two packs of the FFN input
    "all-static": ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
}


def _chain(modulated: bool, seed: int, static_layers=()):
    return [make_block(TINY, modulated=modulated, seed=seed + i, static_layers=static_layers) for i in range(2)]


CASES = [("dynamic", tzi, batch) for tzi in (False, True) for batch in (1, 2)]
CASES += [(variant, tzi, 2) for variant in STATIC if variant != "dynamic" for tzi in (False, True)]


@pytest.mark.parametrize("variant,tzi,batch", CASES)
def test_modulated_blocks_match_comfyui(variant, tzi, batch):
    """Two consecutive modulated blocks (noise refiner / layers): the hand-over of norm statistics included."""
    seed = fresh_seed()
    blocks = _chain(True, seed, STATIC[variant])
    inputs = make_inputs(TINY, batch, TOKENS, seed=seed + 5, timestep_zero_index=TIMESTEP_ZERO_INDEX if tzi else None)
    stock = stock_blocks(blocks, inputs)
    fused = fused_blocks(blocks, inputs, twin_ops)
    assert_bit_identical(fused, stock, f"{variant}, timestep_zero_index {tzi}, batch {batch}, seed {seed}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("variant", ["dynamic", "all-static"])
def test_refiner_blocks_match_comfyui(variant, batch):
    """Two context-refiner blocks (no modulation, no gates)."""
    seed = fresh_seed()
    blocks = _chain(False, seed, STATIC[variant])
    inputs = make_inputs(TINY, batch, TOKENS, seed=seed + 5, modulated=False)
    assert_bit_identical(fused_blocks(blocks, inputs, twin_ops), stock_blocks(blocks, inputs),
                         f"refiner {variant}, batch {batch}, seed {seed}")
