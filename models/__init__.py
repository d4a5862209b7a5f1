"""Model fusions, one folder per model family; each finds its blocks in a ComfyUI model and patches them on a
ModelPatcher clone with the core's fused Linear and its own fused forwards."""
