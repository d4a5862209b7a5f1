"""Z-Image Turbo (ComfyUI's Lumina 2 ``NextDiT`` with ``z_image_modulation``): the self-check probes of its fused
ops and the adaLN rows of its tokens (the fused block follows on the shared block-fusion toolkit)."""
