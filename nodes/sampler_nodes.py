"""Chorus Sparse Wan Sampler: KSampler with block-sparse self-attention from the mask bank."""

from __future__ import annotations

import comfy.samplers
from comfy_api.latest import io

from . import CATEGORY
from .input_checks import density_range_problem
from .reuse_common import NodeEvents, model_source_files, reuse_option_inputs, reuse_options
from .sparse_attention_node import ChorusSparseAttention


class ChorusSparseWanSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusSparseWanSampler",
            display_name="Chorus Sparse Wan Sampler",
            category=CATEGORY,
            description="KSampler for Wan 2.1 with block-sparse self-attention. On a bank hit it reuses the matched "
                        "request's masks; on a miss it predicts masks online (or uses the bank's population prior, or runs "
                        "dense) and, with recording on, "
                        "adds this run's masks to the bank after the run succeeds.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 model (I2V or T2V). Other models are refused."),
                io.Conditioning.Input("positive", tooltip="From WanImageToVideo, as for KSampler."),
                io.Conditioning.Input("negative", tooltip="From WanImageToVideo, as for KSampler."),
                io.Latent.Input("latent_image", tooltip="The video latent from WanImageToVideo."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed, as for KSampler."),
                io.Int.Input("steps", default=40, min=1, max=10000, tooltip="Denoising steps; a hit takes each step's masks from the bank entry's bucket recorded at the same noise level."),
                io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip="Classifier-free guidance scale, as for KSampler."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS, default="uni_pc",
                               tooltip="Sampler, as for KSampler."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default="simple",
                               tooltip="Noise schedule, as for KSampler."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01, tooltip="Share of the schedule to run, as for KSampler."),
                *reuse_option_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, min_density, max_density):
        # Only the two inputs of the rule (see nodes/input_checks.py): a failure shows on those two,
        # and ComfyUI's own checks still cover every other input. dense_layers is parsed when the
        # node runs (a single error naming it); checking it here too would put every failure on
        # all three inputs.
        return density_range_problem(min_density, max_density) or True

    @classmethod
    def execute(cls, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler, denoise,
                dense_warmup_steps, dense_layers, miss_mode, top_p, min_density, max_density, record_on_miss, tag,
                match=None, dense_attention="auto", hit_warmup_steps=0, dense_last_steps=1,
                attention_precision="bf16") -> io.NodeOutput:
        import nodes as comfy_nodes

        from ..chorus_core.reuse.reuse_run import ReusePatch, nothing_sampled
        from ..chorus_core.reuse.reuse_match import match_grid_problem

        options = reuse_options(dense_warmup_steps, dense_layers, miss_mode, top_p, min_density, max_density,
                                record_on_miss, tag, dense_attention, hit_warmup_steps, dense_last_steps,
                                model_source_files(cls.hidden), attention_precision)
        problem = match_grid_problem(match, latent_image["samples"])
        if problem is not None:
            raise ValueError(f"Chorus Sparse Wan Sampler: {problem}")
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        patch = ReusePatch(model, match, options, events=NodeEvents(node_id, max_density, send_report=False),
                           scheduler=scheduler, sampler=sampler_name)
        (latent,) = comfy_nodes.common_ksampler(patch.install(refuse_patched=True), seed, steps, cfg, sampler_name,
                                                scheduler, positive, negative, latent_image, denoise=denoise)
        report = patch.last_report or nothing_sampled(steps)  # denoise 0: ComfyUI samples nothing
        return io.NodeOutput(latent, ui={"chorus_report": [report.to_json()]})


NODES = [ChorusSparseWanSampler, ChorusSparseAttention]  # Chorus Sparse Attention registers with the sampler
