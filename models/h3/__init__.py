"""MiniMax H3: the fused DiT block (norms folded, modulation, SwiGLU, gated residuals, RMSNorm + RoPE, the hand-over
between blocks), its probes and block check, its checkpoints, and the patch that installs it."""
