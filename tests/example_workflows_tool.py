"""Build the example workflows (UI format and API twin) from one API-format definition.

The API graphs below are the source of truth; the UI files that ComfyUI's template browser
shows are derived from them with a running server's ``/object_info`` (widget order, output
types), so the two formats cannot drift apart. Each node's size is measured in the real
frontend (the pinned 1.27.10 and 1.58.1, the larger of the two) and the layout follows from the
sizes: columns by data flow, nodes stacked without overlap, output nodes beside the sampler.
The template browser's thumbnails (``<name>.jpg``) are screenshots of the laid-out graph.
Regenerate after changing a node's inputs (needs Chromium, ``make browser``)::

    .venv/bin/python tests/example_workflows_tool.py
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "example_workflows"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}

# The file names ComfyUI's own Wan 2.1 templates use (Comfy-Org/Wan_2.1_ComfyUI_repackaged).
MODEL_FILES = {
    "480p": "wan2.1_i2v_480p_14B_fp16.safetensors",
    "720p": "wan2.1_i2v_720p_14B_fp16.safetensors",
}
TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
CLIP_VISION = "clip_vision_h.safetensors"
VAE = "wan_2.1_vae.safetensors"
SIZES = {"480p": (832, 480), "720p": (1280, 720)}
PROMPT = "the subject turns towards the camera and smiles, gentle camera push-in, soft daylight"
NEGATIVE = "static, blurry, low quality, deformed, watermark, text"


def wan21_i2v_chorus(resolution: str) -> dict:
    """Wan 2.1 I2V 14B with Chorus: bank loader, similarity match and the sparse sampler."""
    width, height = SIZES[resolution]
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILES[resolution], "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TEXT_ENCODER, "type": "wan", "device": "default"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": ["2", 0]}},
        "5": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": CLIP_VISION}},
        "6": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "7": {"class_type": "CLIPVisionEncode", "inputs": {"clip_vision": ["5", 0], "image": ["6", 0], "crop": "none"}},
        "8": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "9": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["3", 0], "negative": ["4", 0], "vae": ["8", 0], "clip_vision_output": ["7", 0],
            "start_image": ["6", 0], "width": width, "height": height, "length": 81, "batch_size": 1}},
        "10": {"class_type": "ChorusMaskBankLoader", "inputs": {
            "bank": "(create new bank)", "new_bank_name": f"wan21_i2v_{resolution}", "read_only": False}},
        "11": {"class_type": "ChorusSimilarityMatch", "inputs": {
            "mask_bank": ["10", 0], "model": ["1", 0], "clip_vision_output": ["7", 0], "positive": ["9", 0],
            "latent": ["9", 2], "threshold": 0.9, "clip_weight": 0.5, "text_weight": 0.3, "layout_weight": 0.2,
            "block_size": 128}},
        "12": {"class_type": "ChorusSparseWanSampler", "inputs": {
            "model": ["1", 0], "positive": ["9", 0], "negative": ["9", 1], "latent_image": ["9", 2],
            "match": ["11", 0], "seed": 42, "steps": 40, "cfg": 5.0, "sampler_name": "uni_pc",
            "scheduler": "simple", "denoise": 1.0, "dense_warmup_steps": 1, "dense_layers": "",
            "miss_mode": "prior", "top_p": 0.9, "min_density": 0.05, "max_density": 0.5,
            "record_on_miss": True, "tag": "my_effect_template", "dense_attention": "auto"}},
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["8", 0]}},
        "14": {"class_type": "CreateVideo", "inputs": {"images": ["13", 0], "fps": 16.0}},
        "15": {"class_type": "SaveVideo", "inputs": {"video": ["14", 0], "filename_prefix": "video/chorus_wan21_i2v",
                                                     "format": "auto", "codec": "auto"}},
        "16": {"class_type": "PreviewAny", "inputs": {"source": ["11", 1]}},
    }


def wan21_i2v_chorus_extras(resolution: str) -> dict:
    """The same graph with the optional nodes: Guidance Enhance and Feature Reuse before the sampler."""
    prompt = wan21_i2v_chorus(resolution)
    prompt["17"] = {"class_type": "ChorusGuidanceEnhance", "inputs": {
        "model": ["1", 0], "method": "cross_attention", "strength": 0.1, "start": 0.1, "end": 1.0}}
    # Feature Reuse stays off (strength 0): it costs quality (README); the node shows where it goes.
    prompt["18"] = {"class_type": "ChorusFeatureReuse", "inputs": {
        "model": ["17", 0], "positive": ["9", 0], "latent": ["9", 2], "strength": 0.0, "cell": "1x2x2",
        "start_percent": 0.3, "end_percent": 1.0, "rim": 1, "blend": True}}
    prompt["19"] = {"class_type": "PreviewImage", "inputs": {"images": ["18", 1]}}
    prompt["12"]["inputs"]["model"] = ["18", 0]
    return prompt


def wan21_i2v_chorus_model_patch(resolution: str = "480p") -> dict:
    """The Chorus example with the MODEL patch instead of the Sparse Wan Sampler, under SamplerCustomAdvanced."""
    prompt = wan21_i2v_chorus(resolution)
    sampler = prompt.pop("12")["inputs"]
    reuse = {k: sampler[k] for k in ("match", "dense_warmup_steps", "dense_layers", "miss_mode", "top_p",
                                     "min_density", "max_density", "record_on_miss", "tag", "dense_attention")}
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


def wan21_i2v_chorus_compiled(resolution: str = "720p") -> dict:
    """The Chorus example with ComfyUI's TorchCompileModel on the model: a hit compiles into one graph
    (the fastest path measured, README "Benchmarks"); the first run of a resolution compiles."""
    prompt = wan21_i2v_chorus(resolution)
    prompt["25"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["1", 0], "backend": "inductor"}}
    prompt["12"]["inputs"]["model"] = ["25", 0]
    return prompt


DISTILL_LORA = "lightx2v_I2V_14B_480p_cfg_step_distill_rank64_bf16.safetensors"  # LightX2V's 4-step LoRA


def wan21_i2v_chorus_step_distilled(resolution: str = "480p") -> dict:
    """Step-distilled Wan 2.1 I2V: a distillation LoRA, 4 steps at cfg 1, Chorus Sparse Attention in front
    of a plain KSampler. Similarity Match gets the same LoRA'd model the sampler runs (the entry's model)."""
    prompt = wan21_i2v_chorus(resolution)
    sampler = prompt.pop("12")["inputs"]
    prompt["26"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["1", 0], "lora_name": DISTILL_LORA, "strength_model": 1.0}}
    prompt["27"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": ["26", 0], "shift": 8.0}}
    prompt["11"]["inputs"]["model"] = ["27", 0]
    reuse = {k: sampler[k] for k in ("match", "dense_warmup_steps", "dense_layers", "miss_mode", "top_p",
                                     "min_density", "max_density", "record_on_miss", "tag", "dense_attention")}
    prompt["20"] = {"class_type": "ChorusSparseAttention", "inputs": {
        "model": ["27", 0], **reuse, "hit_warmup_steps": 0, "dense_last_steps": 1,
        "attention_precision": "bf16"}}
    prompt["12"] = {"class_type": "KSampler", "inputs": {
        "model": ["20", 0], "seed": sampler["seed"], "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["9", 0], "negative": ["9", 1], "latent_image": ["9", 2], "denoise": 1.0}}
    return prompt


# ComfyUI's official templates (comfyui-workflow-templates on PyPI), as users start from them: the same
# node ids, models, LoRAs, samplers, sizes and prompts; Chorus adds its nodes with ids from 200 and
# changes only the sampler's model input. Wan 2.2 14B I2V: video_wan2_2_14B_i2v.json, its 4-step
# LightX2V path (two fp8_scaled experts, steps 0-2 on the high-noise one, 2-4 on the low-noise one).
WAN22_MODELS = {"high": "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors",
                "low": "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors"}
WAN22_LORAS = {"high": "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
               "low": "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors"}
TEMPLATE_PROMPT = ("The white dragon warrior stands still, eyes full of determination and strength. The camera "
                   "slowly moves closer or circles around the warrior, highlighting the powerful presence and "
                   "heroic spirit of the character.")
TEMPLATE_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
                     "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，"
                     "形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
# expert -> (UNETLoader, LoraLoaderModelOnly, ModelSamplingSD3, KSamplerAdvanced) ids in the template
WAN22_EXPERT_NODES = {"high": ("95", "101", "104", "86"), "low": ("96", "102", "103", "85")}


def wan22_i2v_14b_template() -> dict:
    """The official Wan 2.2 14B I2V template's live graph, as ComfyUI queues it."""
    prompt = {
        "84": {"class_type": "CLIPLoader", "inputs": {"clip_name": TEXT_ENCODER, "type": "wan", "device": "default"}},
        "90": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "97": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "93": {"class_type": "CLIPTextEncode", "inputs": {"text": TEMPLATE_PROMPT, "clip": ["84", 0]}},
        "89": {"class_type": "CLIPTextEncode", "inputs": {"text": TEMPLATE_NEGATIVE, "clip": ["84", 0]}},
        "98": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["93", 0], "negative": ["89", 0], "vae": ["90", 0], "start_image": ["97", 0],
            "width": 640, "height": 640, "length": 81, "batch_size": 1}},
        "87": {"class_type": "VAEDecode", "inputs": {"samples": ["85", 0], "vae": ["90", 0]}},
        "94": {"class_type": "CreateVideo", "inputs": {"images": ["87", 0], "fps": 16.0}},
        "108": {"class_type": "SaveVideo", "inputs": {"video": ["94", 0], "filename_prefix": "video/ComfyUI",
                                                      "format": "auto", "codec": "auto"}},
    }
    stages = {"high": ("enable", 0, 2, "enable", ["98", 2]), "low": ("disable", 2, 4, "disable", ["86", 0])}
    for expert, (unet, lora, sampling, sampler) in WAN22_EXPERT_NODES.items():
        add_noise, start, end, leftover, latent = stages[expert]
        prompt[unet] = {"class_type": "UNETLoader", "inputs": {"unet_name": WAN22_MODELS[expert], "weight_dtype": "default"}}
        prompt[lora] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": [unet, 0], "lora_name": WAN22_LORAS[expert], "strength_model": 1.0}}
        prompt[sampling] = {"class_type": "ModelSamplingSD3", "inputs": {"model": [lora, 0], "shift": 5.0}}
        prompt[sampler] = {"class_type": "KSamplerAdvanced", "inputs": {
            "model": [sampling, 0], "add_noise": add_noise, "noise_seed": 42, "steps": 4, "cfg": 1.0,
            "sampler_name": "euler", "scheduler": "simple", "positive": ["98", 0], "negative": ["98", 1],
            "latent_image": latent, "start_at_step": start, "end_at_step": end, "return_with_leftover_noise": leftover}}
    return prompt


def wan21_i2v_template() -> dict:
    """The official Wan 2.1 I2V template (image_to_video_wan.json): fp16 weights, 20 steps, cfg 6, uni_pc."""
    return {
        "37": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILES["480p"], "weight_dtype": "default"}},
        "38": {"class_type": "CLIPLoader", "inputs": {"clip_name": TEXT_ENCODER, "type": "wan", "device": "default"}},
        "39": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "49": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": CLIP_VISION}},
        "52": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cute anime girl with massive fennec ears and a big "
                                                         "fluffy tail wearing a maid outfit turning around",
                                                         "clip": ["38", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": TEMPLATE_NEGATIVE, "clip": ["38", 0]}},
        "51": {"class_type": "CLIPVisionEncode", "inputs": {"clip_vision": ["49", 0], "image": ["52", 0], "crop": "none"}},
        "50": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["6", 0], "negative": ["7", 0], "vae": ["39", 0], "clip_vision_output": ["51", 0],
            "start_image": ["52", 0], "width": 512, "height": 512, "length": 33, "batch_size": 1}},
        "54": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["37", 0], "shift": 8.0}},
        "3": {"class_type": "KSampler", "inputs": {
            "model": ["54", 0], "seed": 42, "steps": 20, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple",
            "positive": ["50", 0], "negative": ["50", 1], "latent_image": ["50", 2], "denoise": 1.0}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["39", 0]}},
        "55": {"class_type": "CreateVideo", "inputs": {"images": ["8", 0], "fps": 16.0}},
        "56": {"class_type": "SaveVideo", "inputs": {"video": ["55", 0], "filename_prefix": "video/ComfyUI",
                                                     "format": "auto", "codec": "auto"}},
    }


CHORUS_BANK_ID = "200"


def insert_chorus(prompt: dict, sampler: str, bank_name: str, tag: str, first_id: int) -> dict:
    """Chorus in front of one sampler, as the README recommends: a Similarity Match on the model the sampler
    runs and Chorus Sparse Attention between that model and the sampler; one Mask Bank Loader per graph."""
    inputs = prompt[sampler]["inputs"]
    model = inputs["model"]
    conditioning = next(node for node, spec in prompt.items() if spec["class_type"] == "WanImageToVideo")
    clip = prompt[conditioning]["inputs"].get("clip_vision_output")
    prompt.setdefault(CHORUS_BANK_ID, {"class_type": "ChorusMaskBankLoader", "inputs": {
        "bank": "(create new bank)", "new_bank_name": bank_name, "read_only": False}})
    match, patch = str(first_id), str(first_id + 1)
    prompt[match] = {"class_type": "ChorusSimilarityMatch", "inputs": {
        "mask_bank": [CHORUS_BANK_ID, 0], "model": model, **({"clip_vision_output": clip} if clip else {}),
        "positive": [conditioning, 0], "latent": [conditioning, 2], "threshold": 0.9, "clip_weight": 0.5,
        "text_weight": 0.3, "layout_weight": 0.2, "block_size": 128}}
    prompt[patch] = {"class_type": "ChorusSparseAttention", "inputs": {
        "model": model, "match": [match, 0], "dense_warmup_steps": 1, "dense_layers": "", "miss_mode": "prior",
        "top_p": 0.9, "min_density": 0.05, "max_density": 0.5, "record_on_miss": True, "tag": tag,
        "dense_attention": "auto", "hit_warmup_steps": 0, "dense_last_steps": 1,
        "attention_precision": "bf16"}}
    inputs["model"] = [patch, 0]
    return prompt


def wan22_i2v_14b_template_chorus() -> dict:
    """The official Wan 2.2 14B I2V template with Chorus on each expert (each records and hits its own entries)."""
    prompt = wan22_i2v_14b_template()
    for index, (expert, (*_, sampler)) in enumerate(WAN22_EXPERT_NODES.items()):
        insert_chorus(prompt, sampler, "wan22_i2v_14b", f"my_effect_template_{expert}_noise", 201 + 2 * index)
    return prompt


def wan21_i2v_template_chorus() -> dict:
    """The official Wan 2.1 I2V template with Chorus in front of its KSampler."""
    return insert_chorus(wan21_i2v_template(), "3", "wan21_i2v_480p", "my_effect_template", 201)


TESTBED_MODEL = "chorus_testbed_wan21_i2v.safetensors"  # tests/testbed/, 16 MB, in the repository


def testbed_check_install() -> dict:
    """The Chorus nodes on the built-in testbed model and a procedural request: no 30 GB of weights,
    runs on a CPU in seconds. Queue it twice: a miss that records, then a hit."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": TESTBED_MODEL, "weight_dtype": "default"}},
        "2": {"class_type": "ChorusTestbedRequest", "inputs": {
            "template": "pan", "subject": 0, "layout": 0, "latent_frames": 5, "latent_height": 16, "latent_width": 16}},
        "3": {"class_type": "ChorusSparseWanSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2],
            "match": ["6", 0], "seed": 0, "steps": 8, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0, "dense_warmup_steps": 1, "dense_layers": "", "miss_mode": "prior", "top_p": 0.9,
            "min_density": 0.1, "max_density": 0.6, "record_on_miss": True, "tag": "pan", "dense_attention": "auto"}},
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "chorus_testbed"}},
        "5": {"class_type": "ChorusMaskBankLoader", "inputs": {
            "bank": "(create new bank)", "new_bank_name": "chorus_testbed", "read_only": False}},
        "6": {"class_type": "ChorusSimilarityMatch", "inputs": {
            "mask_bank": ["5", 0], "model": ["1", 0], "clip_vision_output": ["2", 3], "positive": ["2", 0],
            "latent": ["2", 2], "start_latent": ["2", 4], "threshold": 0.9, "clip_weight": 0.5, "text_weight": 0.3,
            "layout_weight": 0.2, "block_size": 32}},
        "7": {"class_type": "PreviewAny", "inputs": {"source": ["6", 1]}},
    }


WORKFLOWS = {f"chorus_wan21_i2v_{r}": (lambda r=r: wan21_i2v_chorus(r)) for r in ("480p", "720p")}
WORKFLOWS["chorus_wan21_i2v_720p_torch_compile"] = wan21_i2v_chorus_compiled
WORKFLOWS["chorus_wan21_i2v_480p_guidance_feature_reuse"] = lambda: wan21_i2v_chorus_extras("480p")
WORKFLOWS["chorus_wan21_i2v_480p_sampler_custom_advanced"] = wan21_i2v_chorus_model_patch
WORKFLOWS["chorus_wan21_i2v_480p_step_distilled"] = wan21_i2v_chorus_step_distilled
WORKFLOWS["chorus_testbed_check_install"] = testbed_check_install
WORKFLOWS["chorus_official_wan22_i2v_14b"] = wan22_i2v_14b_template_chorus
WORKFLOWS["chorus_official_wan21_i2v"] = wan21_i2v_template_chorus

_WAN_FILES = ("Needs the Wan 2.1 files of ComfyUI's own templates: {model} (diffusion_models), "
              f"{TEXT_ENCODER} (text_encoders), {CLIP_VISION} (clip_vision), {VAE} (vae).")
# The template browser shows only file names (frontends 1.27.10 and 1.58.1 read no title or
# description for a custom node's templates), so each graph carries its own, in a note.
TEMPLATES = {
    "chorus_wan21_i2v_480p": ("Chorus: Wan 2.1 image-to-video, 480p", (
        "Mask Bank Loader, Similarity Match and the Sparse Wan Sampler around Wan 2.1 I2V 14B. The first run of a "
        "request is a miss that records its sparse attention masks; a similar later request hits and reuses them. "
        + _WAN_FILES.format(model=MODEL_FILES["480p"]))),
    "chorus_wan21_i2v_720p": ("Chorus: Wan 2.1 image-to-video, 720p", (
        "The 480p graph at 1280x720, where sparse attention saves the most. "
        + _WAN_FILES.format(model=MODEL_FILES["720p"]))),
    "chorus_wan21_i2v_720p_torch_compile": ("Chorus: Wan 2.1 I2V 720p, compiled", (
        "ComfyUI's TorchCompileModel on the model: a hit compiles into one graph, the fastest path measured. Needs "
        "Triton; the first run at each resolution compiles first. " + _WAN_FILES.format(model=MODEL_FILES["720p"]))),
    "chorus_wan21_i2v_480p_guidance_feature_reuse": ("Chorus: Wan 2.1 I2V 480p with Guidance Enhance", (
        "Guidance Enhance (cross_attention, 0.1) in front of the sampler recovers content lost to reuse. Feature "
        "Reuse is wired but off (strength 0): it costs quality; raise it only to try it. "
        + _WAN_FILES.format(model=MODEL_FILES["480p"]))),
    "chorus_wan21_i2v_480p_sampler_custom_advanced": ("Chorus: Wan 2.1 I2V 480p, any sampler", (
        "Chorus Sparse Attention patches the MODEL, so SamplerCustomAdvanced (or any sampler) runs with the bank's "
        "masks. " + _WAN_FILES.format(model=MODEL_FILES["480p"]))),
    "chorus_wan21_i2v_480p_step_distilled": ("Chorus: step-distilled Wan 2.1 I2V, 4 steps at cfg 1", (
        "A distillation LoRA (LightX2V's " + DISTILL_LORA + " in loras; any step-distill LoRA works) and "
        "ModelSamplingSD3, then Chorus Sparse Attention before a plain KSampler at 4 steps and cfg 1. A hit runs "
        "sparse from the first step (hit_warmup_steps 0); a miss keeps one dense step to record from. Similarity "
        "Match gets the same LoRA'd model the sampler runs: an entry belongs to the model that recorded it. "
        + _WAN_FILES.format(model=MODEL_FILES["480p"]))),
    "chorus_official_wan22_i2v_14b": ("Chorus in ComfyUI's Wan 2.2 14B I2V template", (
        "ComfyUI's own Wan 2.2 14B image-to-video template (two fp8_scaled experts, the LightX2V 4-step LoRAs, "
        "4 steps at cfg 1, 640x640x81) with Chorus on each expert: one Mask Bank Loader, and per expert a Similarity "
        "Match on the model its KSamplerAdvanced runs and Chorus Sparse Attention in front of it. Each expert "
        "records and hits entries of its own. Needs the template's files: " + ", ".join(WAN22_MODELS.values())
        + " (diffusion_models), " + ", ".join(WAN22_LORAS.values()) + f" (loras), {TEXT_ENCODER}, {VAE}.")),
    "chorus_official_wan21_i2v": ("Chorus in ComfyUI's Wan 2.1 I2V template", (
        "ComfyUI's own Wan 2.1 image-to-video template (fp16 weights, 20 steps at cfg 6, uni_pc, 512x512x33) with "
        "Chorus in front of its KSampler: Mask Bank Loader, Similarity Match and Chorus Sparse Attention. "
        + _WAN_FILES.format(model=MODEL_FILES["480p"]))),
    "chorus_testbed_check_install": ("Chorus: check an install on the testbed model", (
        "Runs in seconds on a CPU, with no download: copy tests/testbed/" + TESTBED_MODEL + " from this pack into "
        "models/diffusion_models, then queue twice. The first run is a miss that records (the view on the sampler "
        "says MISS and what it recorded), the second a HIT of that entry.")),
}
NOTE_TYPE = "MarkdownNote"  # a frontend-only node: not in /object_info, never in the API prompt
NOTE_SIZE = [640, 200]


def _inputs_in_order(spec: dict) -> list[tuple[str, list]]:
    ordered = list(spec["input"].get("required", {}).items()) + list(spec["input"].get("optional", {}).items())
    return [(name, value) for name, value in ordered]


def _is_widget(value: list) -> bool:
    kind = value[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _depths(prompt: dict) -> dict[str, int]:
    depth: dict[str, int] = {}

    def visit(node_id: str) -> int:
        if node_id not in depth:
            links = [v for v in prompt[node_id]["inputs"].values() if isinstance(v, list)]
            depth[node_id] = 1 + max((visit(str(l[0])) for l in links), default=-1)
        return depth[node_id]

    for node_id in prompt:
        visit(node_id)
    return depth


TITLE_HEIGHT = 30  # LiteGraph draws the title bar above a node's pos
GAP = 40  # between stacked nodes and between columns
SAMPLER_TYPES = {"ChorusSparseWanSampler", "KSampler", "KSamplerAdvanced", "SamplerCustomAdvanced"}


def estimated_size(spec: dict) -> list[int]:
    """Without a measurement: room for every socket and widget row (about 24 px a row)."""
    rows = len(_inputs_in_order(spec)) + len(spec["output"])
    return [400, 40 + 24 * rows]


def columns(prompt: dict, object_info: dict) -> dict[str, int]:
    """Left to right by data flow; output nodes (previews, savers) go beside the sampler, never in
    its column, so that they cannot sit on it."""
    depth = _depths(prompt)
    samplers = [depth[n] for n, node in prompt.items() if node["class_type"] in SAMPLER_TYPES]
    beside = max(samplers, default=-1) + 1
    return {node_id: max(depth[node_id], beside) if object_info[node["class_type"]].get("output_node") else depth[node_id]
            for node_id, node in prompt.items()}


def layout(prompt: dict, object_info: dict, sizes: dict[str, list]) -> dict[str, list[int]]:
    """Positions from each node's size: columns as wide as their widest node, nodes stacked with a gap."""
    column = columns(prompt, object_info)
    order = sorted(prompt, key=lambda n: (column[n], int(n)))
    widths: dict[int, int] = {}
    for node_id in order:
        widths[column[node_id]] = max(widths.get(column[node_id], 0), sizes[node_id][0])
    lefts, x = {}, 40
    for c in sorted(widths):
        lefts[c], x = x, x + widths[c] + GAP
    tops: dict[int, int] = {}
    positions = {}
    for node_id in order:
        c = column[node_id]
        top = tops.get(c, 40)
        positions[node_id] = [lefts[c], top + TITLE_HEIGHT]
        tops[c] = top + TITLE_HEIGHT + sizes[node_id][1] + GAP
    return positions


def api_to_ui(prompt: dict, object_info: dict, sizes: dict | None = None, note: tuple[str, str] | None = None) -> dict:
    """A UI-format workflow equivalent to the API-format ``prompt``.

    :param sizes: node id -> [width, height] as the frontend draws the node (``--measure`` finds
        them); an estimate for nodes without one.
    :param note: (title, description) shown in a note below the graph.
    """
    sizes = {n: list((sizes or {}).get(n) or estimated_size(object_info[node["class_type"]]))
             for n, node in prompt.items()}
    positions = layout(prompt, object_info, sizes)
    links, nodes = [], {}
    column = columns(prompt, object_info)
    for node_id, node in sorted(prompt.items(), key=lambda item: (column[item[0]], int(item[0]))):
        spec = object_info[node["class_type"]]
        nodes[node_id] = {
            "id": int(node_id), "type": node["class_type"], "pos": positions[node_id],
            "size": sizes[node_id], "flags": {}, "order": 0, "mode": 0, "inputs": [],
            "outputs": [{"name": name, "type": kind, "links": [], "slot_index": i}
                        for i, (name, kind) in enumerate(zip(spec["output_name"], spec["output"]))],
            "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": [],
        }
    depth = _depths(prompt)
    for order, node_id in enumerate(sorted(prompt, key=lambda n: (depth[n], int(n)))):
        _fill_node(nodes[node_id], prompt[node_id], object_info, nodes, links, order)
    if note is not None:
        note_id = str(max(int(n) for n in prompt) + 1)
        nodes[note_id] = _note_node(int(note_id), note, positions, sizes, len(prompt))
    return {"last_node_id": max(int(n) for n in nodes), "last_link_id": len(links), "nodes": list(nodes.values()),
            "links": links, "groups": [], "config": {}, "extra": {"frontendVersion": "1.27.10"}, "version": 0.4}


def _note_node(node_id: int, note: tuple[str, str], positions: dict, sizes: dict, order: int) -> dict:
    """The template's title and description, below the lowest node."""
    title, description = note
    bottom = max(positions[n][1] + sizes[n][1] for n in positions)
    return {"id": node_id, "type": NOTE_TYPE, "title": title, "pos": [40, bottom + GAP + TITLE_HEIGHT],
            "size": list(NOTE_SIZE), "flags": {}, "order": order, "mode": 0, "inputs": [], "outputs": [],
            "properties": {}, "widgets_values": [f"## {title}\n\n{description}"]}


def sizes_of(ui: dict) -> dict[str, list]:
    """The node sizes a UI file was laid out with."""
    return {str(node["id"]): node["size"] for node in ui["nodes"]}


def _fill_node(ui_node, api_node, object_info, nodes, links, order):
    ui_node["order"] = order
    for name, value in _inputs_in_order(object_info[api_node["class_type"]]):
        given = api_node["inputs"].get(name)
        if _is_widget(value):
            ui_node["widgets_values"].append(given if given is not None else value[1].get("default") if len(value) > 1 else None)
            if len(value) > 1 and value[1].get("control_after_generate"):
                ui_node["widgets_values"].append("fixed")
            continue
        slot = len(ui_node["inputs"])
        link_id = None
        if isinstance(given, list):
            link_id = len(links) + 1
            origin = nodes[str(given[0])]
            kind = origin["outputs"][given[1]]["type"]
            links.append([link_id, int(given[0]), given[1], ui_node["id"], slot, kind])
            origin["outputs"][given[1]]["links"].append(link_id)
        ui_node["inputs"].append({"name": name, "type": value[0], "link": link_id})


def write_examples(object_info: dict, sizes: dict, out: Path = EXAMPLES) -> list[Path]:
    """Write every workflow; ``sizes`` maps workflow name -> node id -> measured [w, h]."""
    # API twins go one folder down: ComfyUI's template browser lists only the top level.
    (out / "api").mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in WORKFLOWS.items():
        prompt = build()
        ui = api_to_ui(prompt, object_info, sizes.get(name), TEMPLATES[name])
        (out / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        (out / "api" / f"{name}_api.json").write_text(json.dumps(prompt, indent=1) + "\n")
        written += [out / f"{name}.json", out / "api" / f"{name}_api.json"]
    return written


# --- measuring in the real frontend ---------------------------------------------------------
APP = "(window.app ?? window.comfyAPI?.app?.app)"
THUMBNAIL_WIDTH = 512


def _browser(url: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_script_timeout(120)
    driver.get(url + "/")
    for _ in range(240):
        if driver.execute_script(f"return !!{APP}?.graph && !!window.LiteGraph?.registered_node_types?.KSampler"):
            return driver
        time.sleep(0.5)
    raise TimeoutError(f"the frontend at {url} did not start")


def _load(driver, workflow: dict) -> None:
    driver.execute_async_script(f"const done = arguments[arguments.length - 1]; "
                                f"{APP}.loadGraphData(arguments[0]).then(() => done(true));", workflow)


# Nodes that show content get room for it beyond their widgets' minimum: the start image's
# preview, the summary text, the prompts.
ROOM = {"LoadImage": [300, 340], "PreviewImage": [300, 300], "PreviewAny": [400, 160], "CLIPTextEncode": [400, 150]}


def measured_sizes(driver, workflow: dict) -> dict[str, list[int]]:
    """Each node's own minimum size in this frontend (LGraphNode.computeSize), rounded up to 10 px."""
    _load(driver, workflow)
    found = driver.execute_script(f"return {APP}.graph._nodes.map(n => [String(n.id), n.type, n.computeSize()])")
    sizes = {}
    for node_id, kind, (w, h) in found:
        room_w, room_h = ROOM.get(kind, [300, 0])
        sizes[node_id] = [max(room_w, 10 * math.ceil(w / 10)), max(room_h, 10 * math.ceil(h / 10))]
    return sizes


def save_thumbnail(driver, workflow: dict, path: Path) -> None:
    """The whole graph as the frontend's canvas draws it, as the template browser's .jpg thumbnail."""
    import base64
    import io

    from PIL import Image

    _load(driver, workflow)
    data, box = driver.execute_script(f"""
        const canvas = {APP}.canvas, nodes = {APP}.graph._nodes;
        const left = Math.min(...nodes.map(n => n.pos[0])) - 20, top = Math.min(...nodes.map(n => n.pos[1] - 30)) - 20;
        const right = Math.max(...nodes.map(n => n.pos[0] + n.size[0])) + 20;
        const bottom = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) + 20;
        const element = canvas.canvas;
        const scale = Math.min(element.width / (right - left), element.height / (bottom - top));
        canvas.ds.scale = scale;
        canvas.ds.offset = [-left, -top];
        canvas.draw(true, true);
        return [element.toDataURL("image/png"), [0, 0, (right - left) * scale, (bottom - top) * scale]];
    """)
    with Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1]))) as image:
        image = image.convert("RGB").crop(tuple(round(v) for v in box))
        image.thumbnail((THUMBNAIL_WIDTH, THUMBNAIL_WIDTH))
        image.save(path, "JPEG", quality=82, optimize=True)


def main() -> int:
    """Measure every node in the pinned frontend and the newest one, write the files and thumbnails."""
    import tempfile

    sys.path.insert(0, str(REPO_ROOT))
    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory

    new_root = Path(sys.prefix) / "frontend-1.58.1" / "comfyui_frontend_package" / "static"
    # the newest first: thumbnails come from the pinned one, once every size is known
    frontends = [("--front-end-root", str(new_root)), ()] if new_root.is_dir() else [()]
    sizes: dict[str, dict] = {}
    object_info = None
    for extra in frontends:
        with tempfile.TemporaryDirectory() as tmp, \
                ComfyServer(prepare_base_directory(Path(tmp)), extra_args=extra) as server:
            object_info = object_info or server.get_json("/object_info")
            driver = _browser(server.url)
            try:
                for name, build in WORKFLOWS.items():
                    found = measured_sizes(driver, api_to_ui(build(), object_info))
                    known = sizes.setdefault(name, {})
                    for node_id, (w, h) in found.items():
                        old = known.get(node_id, [0, 0])
                        known[node_id] = [max(old[0], w), max(old[1], h)]
                if not extra:
                    for name, build in WORKFLOWS.items():
                        save_thumbnail(driver, api_to_ui(build(), object_info, sizes[name], TEMPLATES[name]),
                                       EXAMPLES / f"{name}.jpg")
            finally:
                driver.quit()
    for path in write_examples(object_info, sizes):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
