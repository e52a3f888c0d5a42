"""Import the pack's sibling library ``kernels`` the same way ``chorus_core`` was imported.

Inside ComfyUI both live under the pack's package (``<pack>.kernels``); in tests and tools
they are top-level. Importing through the parent package keeps a bare ``kernels`` module
out of ComfyUI's ``sys.modules``, where another pack could own that name.
"""

import importlib

_parent_package = __package__.rpartition(".")[0]


def import_sibling(name: str):
    """Return the sibling package ``name`` (e.g. ``"kernels"``) of ``chorus_core``."""
    qualified = f"{_parent_package}.{name}" if _parent_package else name
    return importlib.import_module(qualified)
