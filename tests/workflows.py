"""API-format workflows used by the end-to-end tests and the demo."""

TINY_MODEL_NAME = "chorus_tiny_wan21_i2v.safetensors"  # random weights, built by the fixtures
TESTBED_MODEL_NAME = "chorus_testbed_wan21_i2v.safetensors"  # trained, committed in tests/testbed/


def tiny_i2v_prompt(template="pan", subject=0, layout=0, seed=0, steps=4, cfg=5.0, prefix="chorus_e2e",
                    model=TINY_MODEL_NAME):
    """UNETLoader(tiny Wan2.1-I2V) -> Chorus Testbed Request -> KSampler -> SaveLatent."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": model, "weight_dtype": "default"}},
        "2": {"class_type": "ChorusTestbedRequest", "inputs": {
            "template": template, "subject": subject, "layout": layout,
            "latent_frames": 5, "latent_height": 16, "latent_width": 16}},
        "3": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2],
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0}},
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": prefix}},
    }


def chorus_i2v_prompt(bank="e2e_bank", template="pan", subject=0, layout=0, seed=0, steps=4, cfg=5.0,
                      threshold=0.9, block_size=32, record_on_miss=True, miss_mode="online",
                      dense_warmup_steps=1, prefix="chorus_e2e", model=TINY_MODEL_NAME):
    """The tiny I2V graph with Chorus: bank loader + similarity match + sparse sampler."""
    prompt = tiny_i2v_prompt(template, subject, layout, seed, steps, cfg, prefix, model)
    prompt["5"] = {"class_type": "ChorusMaskBankLoader", "inputs": {
        "bank": "(create new bank)", "new_bank_name": bank, "read_only": False}}
    prompt["6"] = {"class_type": "ChorusSimilarityMatch", "inputs": {
        "mask_bank": ["5", 0], "model": ["1", 0], "clip_vision_output": ["2", 3], "positive": ["2", 0],
        "latent": ["2", 2], "start_latent": ["2", 4], "threshold": threshold, "clip_weight": 0.5,
        "text_weight": 0.3, "layout_weight": 0.2, "block_size": block_size}}
    prompt["3"] = {"class_type": "ChorusSparseWanSampler", "inputs": {
        "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2],
        "match": ["6", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
        "scheduler": "simple", "denoise": 1.0, "dense_warmup_steps": dense_warmup_steps, "dense_layers": "",
        "miss_mode": miss_mode, "top_p": 0.9, "min_density": 0.1, "max_density": 0.6,
        "record_on_miss": record_on_miss, "tag": template}}
    return prompt
