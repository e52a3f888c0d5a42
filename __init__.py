"""Chorus: faster Wan 2.1 image-to-video in ComfyUI by reusing sparse attention masks.

ComfyUI loads this folder as a custom-node package. Everything is imported relative to
it, so the pack's libraries (``chorus_core``, ``kernels``) never appear in ComfyUI's
``sys.modules`` under bare names that another pack could also use.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI V3 entry point: return the pack's extension (nodes are imported lazily)."""
    from .nodes import ChorusExtension

    return ChorusExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
