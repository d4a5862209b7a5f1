"""Wan (2.1 / 2.2): the self-check probes of the fused ops of its block (LayerNorm statistics with ComfyUI's addcmul
modulation, residuals with the next norm's statistics, full-width RMSNorm + interleaved RoPE, GELU in the down
projection's pack), in fp16 (ComfyUI's compute dtype for Wan on NVIDIA GPUs) and bf16."""
