"""Quality testbed: a small Wan2.1-I2V model (ComfyUI's WanModel) trained on the procedural
workload, and the mask-quality report run on it. See ``train`` and ``report``."""
