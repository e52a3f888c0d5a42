"""What a bank hit composes with, measured in the product path (issue 23, item 3).

Each composed run is compared with its control arm, the same composition without Chorus's
sparse attention, so a row says what the hit costs inside that composition:

- ``guidance_effect``: Guidance Enhance (the node's defaults) on the dense model, against the plain
  dense run: how far guidance itself moves the output, for scale;
- ``hit+guidance``: Guidance Enhance installed after the hit's patch (the node order Chorus Sparse
  Attention -> Guidance Enhance), against dense + guidance;
- ``easycache_alone``: ComfyUI core's EasyCache (its node, its defaults) on the dense model,
  against the plain dense run;
- ``hit+easycache``: EasyCache after the hit's patch, against the plain dense run (both savings
  together, and what they cost together), beside the hit alone in the natural rows.

``steps_skipped`` is what EasyCache reports it skipped (its own log line, read as it is written).
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager

COMPOSED_KINDS = ("guidance_effect", "hit+guidance", "easycache_alone", "hit+easycache")
EASYCACHE_DEFAULTS = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95}  # its node's defaults
_SKIPPED = re.compile(r"EasyCache - skipped (\d+)/(\d+) steps")


class _SkippedSteps(logging.Handler):
    """Reads the steps EasyCache says it skipped from its closing log line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.skipped = None

    def emit(self, record: logging.LogRecord) -> None:
        found = _SKIPPED.search(record.getMessage())
        if found:
            self.skipped = int(found.group(1))


@contextmanager
def easycache_log():
    handler, root = _SkippedSteps(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def with_easycache(patcher):
    """``patcher`` through core's EasyCache node with its defaults (a clone; the input is unchanged)."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    return EasyCacheNode.execute(patcher, verbose=False, **EASYCACHE_DEFAULTS).result[0]


def with_guidance(patcher):
    """``patcher`` with Guidance Enhance at the node's defaults (a clone)."""
    from chorus_core.guidance.guidance import GuidanceSettings, install_guidance

    return install_guidance(patcher, GuidanceSettings())


def composition_rows(pp, match, conds, seed: int, dense_final, quality) -> list[dict]:
    """The four composed rows of one target and seed (``pp``: the run's ProductPath; ``match``: its
    hit; ``quality(reference, final)``: the product path's measures)."""
    from chorus_core.reuse.reuse_run import ReusePatch

    def sampled_hit(compose):
        patch = ReusePatch(pp.patcher, match, pp.options, block_size=pp.bs, scheduler="simple")
        with easycache_log() as log:
            final = pp.sample(compose(patch.install()), conds, seed)
        if patch.last_report.mode != "hit":
            raise RuntimeError(f"a composed hit ran as a {patch.last_report.mode}: {patch.last_report.warnings}")
        return final, patch.last_report.density, log.skipped

    guided_dense = pp.sample(with_guidance(pp.patcher), conds, seed)
    guided_hit, guided_density, _ = sampled_hit(with_guidance)
    with easycache_log() as log:
        cached_dense = pp.sample(with_easycache(pp.patcher), conds, seed)
    cached_hit, cached_density, hit_skipped = sampled_hit(with_easycache)
    return [{"section": "composed", "mask_kind": kind, "against": against, "density": density, "recall": None,
             "recall_vs_oracle": None, "steps_skipped": skipped, **quality(reference, final)}
            for kind, against, reference, final, density, skipped in (
                ("guidance_effect", "dense", dense_final, guided_dense, 1.0, None),
                ("hit+guidance", "dense+guidance", guided_dense, guided_hit, guided_density, None),
                ("easycache_alone", "dense", dense_final, cached_dense, 1.0, log.skipped),
                ("hit+easycache", "dense", dense_final, cached_hit, cached_density, hit_skipped))]
