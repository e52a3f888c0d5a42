"""Guidance and feature reuse: the libraries of the two optional nodes beside sparse attention.

``guidance`` pushes the prediction back toward the conditioning in a window of steps after mask
reuse (a stronger CFG term or scaled cross-attention) and measures condition adherence;
``feature_reuse`` runs Wan blocks at reduced token resolution in redundant regions, chosen by
``feature_regions`` (cell grids, region selection, the region-map image), with ``token_layout``
mapping full-resolution tokens to the reduced ones and back. Nothing is imported
here; import the module you need.
"""
