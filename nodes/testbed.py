"""Chorus Testbed Request: a procedural I2V request, so a graph runs without 30 GB of weights.

Produces what WanImageToVideo + CLIPVisionEncode + CLIPTextEncode would, from the seeded
workload generator in ``chorus_core.testbed.workload``. Use it to check an install, to try the
Chorus nodes on the built-in tiny model, and in tests.
"""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY


class ChorusTestbedRequest(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from ..chorus_core.testbed.workload import TEMPLATES

        return io.Schema(
            node_id="ChorusTestbedRequest",
            display_name="Chorus Testbed Request",
            category=f"{CATEGORY}/testbed",
            description="A procedural image-to-video request (template x subject x layout) in Wan's latent "
                        "space: conditioning, CLIP-vision output and start latent, with no text encoder, "
                        "CLIP vision model or VAE needed. For checking an install and for the tiny testbed model.",
            inputs=[
                io.Combo.Input("template", options=list(TEMPLATES), tooltip="Effect template: the motion program and its text embedding."),
                io.Int.Input("subject", default=0, min=0, max=1000, tooltip="Sprite look (shape, texture, colour)."),
                io.Int.Input("layout", default=0, min=0, max=1000, tooltip="Position, size and background."),
                io.Int.Input("latent_frames", default=5, min=1, max=64, tooltip="Latent frames (video frames = 4 x (n - 1) + 1)."),
                io.Int.Input("latent_height", default=16, min=2, max=256, step=2, tooltip="Latent height (pixels / 8), even."),
                io.Int.Input("latent_width", default=16, min=2, max=256, step=2, tooltip="Latent width (pixels / 8), even."),
            ],
            outputs=[
                io.Conditioning.Output(display_name="positive"),
                io.Conditioning.Output(display_name="negative"),
                io.Latent.Output(display_name="latent"),
                io.ClipVisionOutput.Output(display_name="clip_vision_output"),
                io.Latent.Output(display_name="start_latent"),
            ],
        )

    @classmethod
    def execute(cls, template, subject, layout, latent_frames, latent_height, latent_width) -> io.NodeOutput:
        from ..chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

        request = I2VRequest(template=template, subject=subject, layout=layout, frames=latent_frames,
                             height=latent_height, width=latent_width)
        tensors = generate_request(request)
        positive, negative, latent = i2v_conditioning(tensors)
        clip_vision = positive[0][1]["clip_vision_output"]
        return io.NodeOutput(positive, negative, latent, clip_vision, {"samples": tensors.first_frame[None]})


NODES = [ChorusTestbedRequest]
