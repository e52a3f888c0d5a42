"""API-format workflows used by the end-to-end tests and the demo."""

TINY_MODEL_NAME = "chorus_tiny_wan21_i2v.safetensors"


def tiny_i2v_prompt(template="pan", subject=0, layout=0, seed=0, steps=4, cfg=5.0, prefix="chorus_e2e"):
    """UNETLoader(tiny Wan2.1-I2V) -> Chorus Testbed Request -> KSampler -> SaveLatent."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_MODEL_NAME, "weight_dtype": "default"}},
        "2": {"class_type": "ChorusTestbedRequest", "inputs": {
            "template": template, "subject": subject, "layout": layout,
            "latent_frames": 5, "latent_height": 16, "latent_width": 16}},
        "3": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2],
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0}},
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": prefix}},
    }
