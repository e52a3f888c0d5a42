"""Child process of test_compile_patch's symlinked-install test: the pack imported through a link.

Run as ``python tests/symlinked_install.py LINKED_ROOT COMFYUI WORKDIR`` where LINKED_ROOT is a
symbolic link to the repository (as a linked ``custom_nodes`` folder or a Docker mount gives it).
Every Chorus module is imported through that link, so code paths in tracebacks are link paths.
Prints one JSON line: where ``kernels`` was imported from and the run's fallback stats.
"""

import json
import sys
from pathlib import Path


def main(linked_root: str, comfyui: str, workdir: str) -> None:
    sys.path[:0] = [linked_root, str(Path(linked_root) / "tests")]
    from chorus_core.comfy.comfyui_locator import prepare_in_process

    prepare_in_process(comfyui, cpu=True)
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    import comfy.sd

    import kernels.block_sparse as block_sparse
    from chorus_core.attention.sparse_patch import get_run_stats, install_sparse_attention
    from chorus_core.testbed.tiny_wan import save_tiny_wan_i2v
    from test_compile_patch import compiled, hit_provider, sample

    wan.optimized_attention = attention.attention_pytorch  # as test_compile_patch does: no graph break

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed (test)")

    block_sparse.run_backend = broken
    model = comfy.sd.load_diffusion_model(str(save_tiny_wan_i2v(Path(workdir) / "tiny.safetensors")))
    patched = install_sparse_attention(compiled(model), hit_provider())
    sample(patched)
    stats = get_run_stats(patched)
    print(json.dumps({"kernels_file": block_sparse.__file__, "warnings": stats.warnings,
                      "sparse_calls": stats.sparse_calls, "finished": stats.finished}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
