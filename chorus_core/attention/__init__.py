"""Attention: the block-sparse attention patch and where its masks come from.

``sparse_patch`` installs the hooks on a ComfyUI model (the attention override, block patches and
wrappers in ``hooks``) and ``sparse_run`` holds one run's state, its statistics in ``run_stats``
and its step times in ``step_times``; ``run_keys`` names the shared ``transformer_options`` keys,
``model_checks`` says which models the patch supports. The masks come from a source:
``mask_provider`` defines the two kinds (known before the model runs, or observed while it runs)
and the fixed ones (dense, static), ``mask_sources`` those that observe (recording, online
prediction; a bank entry is served from ``chorus_core.reuse.entry_source``), ``masks`` records and selects blocks and ``online_predictor`` predicts a block
map from a layer's own queries and keys. Nothing is imported here; import the module you need.
"""
