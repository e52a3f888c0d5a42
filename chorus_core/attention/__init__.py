"""Attention: the block-sparse attention patch and where its masks come from.

``sparse_patch`` installs the hooks on a ComfyUI model (the attention override, block patches and
wrappers in ``hooks``) and ``sparse_run`` holds one run's state, its statistics in ``run_stats``
and its step times in ``step_times``; ``run_keys`` names the shared ``transformer_options`` keys,
``model_checks`` says which models the patch supports and ``token_layout`` maps tokens to latent
cells. The masks come from a source: ``mask_provider`` defines the two kinds (known before the
model runs, or observed while it runs), ``mask_sources`` the concrete ones (bank entry, recording,
online prediction), ``masks`` records and selects blocks and ``online_predictor`` predicts a block
map from a layer's own queries and keys. Nothing is imported here; import the module you need.
"""
