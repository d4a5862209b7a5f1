"""Wan (2.1 / 2.2): the fused WanAttentionBlock on the block-fusion toolkit (structure, modulation rows, block,
patch) and the self-check probes of its fused ops (LayerNorm statistics and modulation, residuals, full-width RMSNorm
+ RoPE, GELU), fp16 and bf16."""
