"""Reuse: one generation that looks a request up in the mask bank and reuses, or records, masks.

``reuse_run`` is the run (``ReusePatch``: options, lookup, which mask source each step gets) and
``reuse_match`` the lookup (signature, model fingerprint, latent layout). ``entry_source`` serves
a matched entry's masks by sigma, ``entry_prefetch`` loads them onto the device ahead of the steps
that use them, ``bank_writer``
writes recorded entries in the background, ``model_identity`` fingerprints a ComfyUI model
patcher (weights and patches), and ``population_prior`` with ``prior_store`` builds and keeps the
population prior used when nothing matches. Nothing is imported here; import the module you need.
"""
