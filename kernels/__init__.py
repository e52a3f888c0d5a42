"""Chorus kernels: block-sparse attention (Triton) with pure-torch references.

A plain library with no ComfyUI dependency. Triton is optional: without it, or without a
CUDA device, every op runs its pure-torch reference.
"""
