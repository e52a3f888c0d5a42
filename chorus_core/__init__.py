"""Chorus core: the mask bank, sparse-attention patching and measurement tools.

A plain library: it never imports ComfyUI's node machinery, so tests and command-line
tools can use it directly (``import chorus_core``). Inside ComfyUI it is imported as a
sub-package of the pack, so no bare top-level name leaks into ComfyUI's process.
"""

__version__ = "0.1.0"
