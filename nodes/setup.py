"""Pack start-up: node list, model folders and HTTP routes, gathered in one place."""

from __future__ import annotations

import importlib
import logging

# Feature modules, each exporting NODES (a list of io.ComfyNode classes). A module whose
# optional dependency is missing still imports: its nodes fail when used, with a message.
FEATURE_MODULES: list[str] = ["testbed"]


def node_list() -> list:
    nodes = []
    for name in FEATURE_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        nodes.extend(module.NODES)
    return nodes


def on_load() -> None:
    logging.info("Chorus: loaded %d nodes", len(node_list()))
