"""The pack's ComfyUI nodes (V3 schema). Thin: each ``execute`` calls into ``chorus_core``."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

CATEGORY = "Chorus"


class ChorusExtension(ComfyExtension):
    """Registers every Chorus node; each feature module lists its own nodes."""

    async def on_load(self) -> None:
        from . import setup

        setup.on_load()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from . import setup

        setup.on_load()  # ComfyUI 0.3.64 never calls on_load(); setting up twice is harmless
        return setup.node_list()
