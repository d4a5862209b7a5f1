"""The block-fusion toolkit: what a model family's fused block is made of, shared by every family (models/*).

A family's fused block (``models/<family>/block.py``) subclasses :class:`~.fused_block.FusedBlock` and writes only
its own route through the block; everything around that route is here and knows no family:

* :mod:`.fused_block` - the block patch: the per-call decision (fused, ComfyUI's block, or the first call's block
  check), the stock arm (this pack's patches lifted from the block's submodules), persistent device workspaces, norm
  weights through ComfyUI's cast, and the shared steps of a fused route: a norm (RMSNorm, or LayerNorm with an
  addcmul modulation or its affine parameters) folded into the next projection's pack
  (:meth:`~.fused_block.FusedBlock.norm_source`) and the residual kernels that also produce the next norm's
  statistics (:meth:`~.fused_block.FusedBlock.residual`, the post-norm residual
  :meth:`~.fused_block.FusedBlock.post_norm_residual`, in place or out of place, and
  :meth:`~.fused_block.FusedBlock.layer_norm_residual`);
* :mod:`.state` - what the fused blocks of one patched model share: the block check's status and the hand-over of
  norm statistics from one block to the next;
* :mod:`.check` - the block check (the first fused call compared byte for byte with ComfyUI's block on its real
  input) and its verdict;
* :mod:`.row_index` - the int32 table row of every token (adaLN modulation, gates), built once per forward.

Linears that read one tensor pack it once through core/linear.py's ``SharedInput``.

The fused Linear and its sources (core/linear.py), the forward plan and the self-check's verdicts (core/) and the
kernels (kernels/) are below this layer; a family declares its fused ops as a probe set (core/verdicts.py
``ProbeSet``) in its own folder.
"""
