"""Chorus Feature Reuse: redundant regions of a Wan 2.1 video computed at reduced token resolution."""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from .input_checks import fraction_window_problem

CELLS = ["1x2x2", "2x2x2", "1x4x4"]  # chorus_core.guidance.feature_regions.CELL_CHOICES (kept here: the schema is pure data)


class ChorusFeatureReuse(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusFeatureReuse",
            display_name="Chorus Feature Reuse (experimental)",
            is_experimental=True,
            category=CATEGORY,
            description="Experimental. Runs the smoothest regions of the video (picked from the start frame) at reduced token "
                        "resolution inside the Wan blocks: each cell of tokens is pooled into one, processed with "
                        "the rest, and its update spread back over the cell. Works with Chorus sparse attention "
                        "(the masks follow the reduced layout). Off (strength 0) by default: it costs quality, and "
                        "at Wan 14B width it made a hit slower, not faster (docs/quality.md, Defaults).",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 model (I2V or T2V). Other models are refused."),
                io.Conditioning.Input("positive", tooltip="From WanImageToVideo: carries the start image the regions are picked from."),
                io.Latent.Input("latent", tooltip="The latent the sampler will denoise (gives the video grid)."),
                io.Float.Input("strength", default=0.0, min=0.0, max=1.0, step=0.05,
                               tooltip="Share of the frame's cells that may run reduced, smoothest first (before the rim). 0 = off."),
                io.Combo.Input("cell", options=CELLS, default="1x2x2",
                               tooltip="Tokens (frames x rows x columns) pooled into one."),
                io.Float.Input("start_percent", default=0.3, min=0.0, max=1.0, step=0.01,
                               tooltip="Where reduced steps start, as a fraction of the sigma schedule like ComfyUI's "
                                       "own start_percent (percent_to_sigma): steps whose sigma is above the sigma at "
                                       "start_percent run at full resolution first (they set the layout)."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Fraction of the sigma schedule where full resolution resumes: steps whose sigma "
                                       "is at or below the sigma at end_percent run at full resolution. 1.0 = never."),
                io.Int.Input("rim", default=1, min=0, max=8, tooltip="Cells at each region's border kept at full resolution (removes seams)."),
                io.Boolean.Input("blend", default=True, tooltip="Spread pooled updates smoothly (tent filter) instead of as flat cells."),
                io.Latent.Input("start_latent", optional=True, tooltip="Start-frame latent, when positive carries none."),
            ],
            outputs=[io.Model.Output(display_name="MODEL"), io.Image.Output(display_name="region_map")],
        )

    @classmethod
    def validate_inputs(cls, start_percent, end_percent):
        # only the two inputs of the rule (see input_checks): a failure is shown on those two
        return fraction_window_problem("start_percent", start_percent, "end_percent", end_percent) or True

    @classmethod
    def execute(cls, model, positive, latent, strength, cell, start_percent, end_percent, rim, blend,
                start_latent=None) -> io.NodeOutput:
        from ..chorus_core.guidance.feature_regions import CELL_CHOICES
        from ..chorus_core.guidance.feature_reuse import FeatureReuseSettings, apply_feature_reuse
        from ..chorus_core.reuse.reuse_match import start_latent_from

        settings = FeatureReuseSettings(cell=CELL_CHOICES[cell], start_percent=start_percent,
                                        end_percent=end_percent, rim=rim, blend=blend)
        patched, _, image = apply_feature_reuse(model, latent["samples"], start_latent_from(positive, start_latent),
                                                strength, settings)
        return io.NodeOutput(patched, image)


NODES = [ChorusFeatureReuse]
