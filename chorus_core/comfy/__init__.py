"""ComfyUI process helpers: finding the ComfyUI that Chorus runs against, and running it.

``comfyui_locator`` finds (or clones, or fills from a local git repository) the pinned ComfyUI
checkout and prepares this process to import it; it needs only the standard library, so
``make setup`` runs it (``python -m chorus_core.comfy.comfyui_locator``) before torch is
installed. ``comfyui_process`` runs a headless ComfyUI server with the pack and talks to it over
its HTTP API (the demo, the end-to-end and browser tests). Nothing is imported here; import the
module you need.
"""
