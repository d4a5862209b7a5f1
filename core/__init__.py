"""The model-agnostic core: the fused NVFP4 Linear and its GEMM call, the forward plan, the self-check (verdict
store in verdicts.py, the Linear's probes in probes.py), calibration recording and checkpoint writing."""
