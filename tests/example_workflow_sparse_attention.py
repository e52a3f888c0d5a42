"""API graph of the Chorus Sparse Attention example (SamplerCustomAdvanced), for example_workflows_tool.

The tool derives the UI file, its layout from measured node sizes and the thumbnail from this
graph, as for the other examples; registering it there is one line (see the function's doc).
"""

from __future__ import annotations

from example_workflows_tool import wan21_i2v_chorus

NAME = "chorus_wan21_i2v_480p_sampler_custom_advanced"


def wan21_i2v_chorus_model_patch(resolution: str = "480p") -> dict:
    """The Chorus example with the MODEL patch instead of the Sparse Wan Sampler, under SamplerCustomAdvanced.

    Register in example_workflows_tool: ``WORKFLOWS[NAME] = wan21_i2v_chorus_model_patch``.
    """
    prompt = wan21_i2v_chorus(resolution)
    sampler = prompt.pop("12")["inputs"]
    reuse = {k: sampler[k] for k in ("match", "dense_warmup_steps", "dense_layers", "miss_mode", "top_p",
                                     "min_density", "max_density", "record_on_miss", "tag")}
    prompt["20"] = {"class_type": "ChorusSparseAttention", "inputs": {"model": ["1", 0], **reuse}}
    prompt["21"] = {"class_type": "CFGGuider", "inputs": {
        "model": ["20", 0], "positive": ["9", 0], "negative": ["9", 1], "cfg": sampler["cfg"]}}
    prompt["22"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler["sampler_name"]}}
    prompt["23"] = {"class_type": "BasicScheduler", "inputs": {
        "model": ["20", 0], "scheduler": sampler["scheduler"], "steps": sampler["steps"], "denoise": 1.0}}
    prompt["24"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": sampler["seed"]}}
    prompt["12"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["24", 0], "guider": ["21", 0], "sampler": ["22", 0], "sigmas": ["23", 0],
        "latent_image": ["9", 2]}}
    return prompt
