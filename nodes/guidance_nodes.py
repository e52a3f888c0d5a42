"""Chorus Guidance Enhance: reinforce the image/text conditioning in the steps that reuse masks."""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from .input_checks import fraction_window_problem

METHOD_OPTIONS = ["cfg_boost", "cross_attention"]  # chorus_core.guidance.guidance.METHODS (checked in tests)
DEFAULT_METHOD, DEFAULT_STRENGTH = "cross_attention", 0.1  # tests/benchmarks/results/guidance_testbed.md


class ChorusGuidanceEnhance(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusGuidanceEnhance",
            display_name="Chorus Guidance Enhance",
            category=CATEGORY,
            description="Counters the drift of conditioning that reused sparse masks cause, with no extra model pass. "
                        "Returns a patched copy of the model (the input is not changed); put it before the Chorus "
                        "Sparse Wan Sampler or any ComfyUI sampler. Acts only in the step window.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 model (cfg_boost works with any model)."),
                io.Combo.Input("method", options=METHOD_OPTIONS, default=DEFAULT_METHOD,
                               tooltip="cross_attention (default): scale every cross-attention output (CLIP image and "
                                       "text) by 1 + strength; works at any cfg, including 1. cfg_boost: scale the CFG "
                                       "guidance term (cond - uncond) by 1 + strength; needs cfg > 1: at cfg 1 ComfyUI "
                                       "runs no uncond pass, so it does nothing (logged once per run)."),
                io.Float.Input("strength", default=DEFAULT_STRENGTH, min=0.0, max=10.0, step=0.01,
                               tooltip="0 = off (the model samples exactly as without this node). Keep it small: "
                                       "0.1 recovered most of the content lost to reuse on the testbed; more cost "
                                       "agreement with dense attention."),
                io.Float.Input("start", default=0.1, min=0.0, max=1.0, step=0.01,
                               tooltip="Start of the window as a fraction of the sigma schedule, as in ComfyUI's own "
                                       "nodes (percent_to_sigma): a step is in the window when its sigma is at or below "
                                       "the sigma at start and above the sigma at end. With the simple scheduler, 0.1 "
                                       "skips the first of 10 steps (the dense warm-up step of the Chorus sampler); "
                                       "other schedulers place it by sigma, not by step count."),
                io.Float.Input("end", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="End of the window as a fraction of the sigma schedule: steps whose sigma is at "
                                       "or below the sigma at end are outside it. 1.0 = to the last step."),
            ],
            outputs=[io.Model.Output(display_name="MODEL")],
        )

    @classmethod
    def validate_inputs(cls, start, end):
        # only the two inputs of the rule (see input_checks): a failure is shown on those two
        return fraction_window_problem("start", start, "end", end) or True

    @classmethod
    def execute(cls, model, method, strength, start, end) -> io.NodeOutput:
        from ..chorus_core.guidance.guidance import GuidanceSettings, install_guidance

        return io.NodeOutput(install_guidance(model, GuidanceSettings(method, strength, start, end)))


NODES = [ChorusGuidanceEnhance]
