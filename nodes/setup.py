"""Pack start-up: node list, model folders and HTTP routes, gathered in one place."""

from __future__ import annotations

import importlib
import logging

# Feature modules, each exporting NODES (a list of io.ComfyNode classes). Optional
# dependencies are imported inside the nodes that need them, so a missing one fails that
# node with a message instead of hiding the whole pack.
FEATURE_MODULES: list[str] = ["bank_nodes", "sampler_nodes", "feature_reuse_nodes", "guidance_nodes", "testbed"]


def node_list() -> list:
    nodes = []
    for name in FEATURE_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        nodes.extend(module.NODES)
    return nodes


_loaded = False


def on_load() -> None:
    """Register the bank folder and the HTTP routes, replay spooled recordings, hook the signals; once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import bank_nodes, routes, spool_lifecycle

    bank_nodes.register_bank_folder()
    routes.register()
    spool_lifecycle.on_start(bank_nodes.bank_roots(), bank_nodes.postgres_banks())
    _warn_if_untested_comfyui()
    logging.info("Chorus: %d nodes, banks in %s", len(node_list()), ", ".join(bank_nodes.bank_roots()))


def _warn_if_untested_comfyui() -> None:
    from ..chorus_core.comfy.comfyui_locator import untested_version_line

    try:
        from comfyui_version import __version__ as version
    except ImportError:  # a ComfyUI too old to say its version
        version = None
    line = untested_version_line(version)
    if line:
        logging.warning(line)
