"""Quality testbed: a small Wan2.1-I2V model (ComfyUI's WanModel) trained on the procedural
workload, and the mask-quality report run on it. See ``train`` and ``report``; the workload
generator is ``workload`` and the random tiny model ``tiny_wan``. Research tooling: nothing in
the runtime (nodes/ outside its testbed node, the rest of chorus_core, kernels/) imports it."""
