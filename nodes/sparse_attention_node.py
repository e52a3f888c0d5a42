"""Chorus Sparse Attention: the Sparse Wan Sampler's reuse as a MODEL patch, for any sampler."""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from .input_checks import density_range_problem
from .reuse_common import NodeEvents, model_source_files, reuse_option_inputs, reuse_options


class ChorusSparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusSparseAttention",
            display_name="Chorus Sparse Attention",
            category=CATEGORY,
            description="The Chorus Sparse Wan Sampler's mask reuse as a MODEL patch: put it before any sampler "
                        "(KSampler, KSamplerAdvanced, SamplerCustomAdvanced). Each sampling run with the model is a "
                        "hit (the matched entry's masks) or a miss (online prediction, the bank's prior, or dense), "
                        "and a successful miss is recorded into the bank after the run. Its report goes to the log "
                        "and to the web view.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 model (I2V or T2V). Other models are refused."),
                *reuse_option_inputs(),
            ],
            outputs=[io.Model.Output(display_name="MODEL")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, min_density, max_density):
        # Only the two inputs of the rule, as the sampler node (see nodes/input_checks.py).
        return density_range_problem(min_density, max_density) or True

    @classmethod
    def execute(cls, model, dense_warmup_steps, dense_layers, miss_mode, top_p, min_density, max_density,
                record_on_miss, tag, match=None, dense_attention="auto", hit_warmup_steps=0,
                dense_last_steps=1, attention_precision="bf16") -> io.NodeOutput:
        from ..chorus_core.reuse.reuse_run import ReusePatch

        options = reuse_options(dense_warmup_steps, dense_layers, miss_mode, top_p, min_density, max_density,
                                record_on_miss, tag, dense_attention, hit_warmup_steps, dense_last_steps,
                                model_source_files(cls.hidden), attention_precision)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        patch = ReusePatch(model, match, options, events=NodeEvents(node_id, max_density))
        return io.NodeOutput(patch.install())


NODES = [ChorusSparseAttention]
