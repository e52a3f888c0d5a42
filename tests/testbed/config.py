"""Sizes and hyper-parameters of the quality testbed (model, training, report).

Presets: ``full`` (the committed checkpoint, trained on an H200 in about 3.5 minutes),
``cpu2k`` (the report of that checkpoint at 2,048 tokens on a 2-core CPU), ``smoke`` (a few
CPU seconds; what ``tests/test_testbed.py`` runs), ``sharp16k`` / ``tiny_sharp`` (issue 16) and
the probe candidates of issue 23 (``PROBE_CANDIDATES``). Every field can be
overridden from the command line of ``train`` / ``report`` with ``--set name=value``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

# Latent grids (frames, height, width); tokens = frames * (height / 2) * (width / 2).
SHORT_SIZE = (5, 16, 16)     # 320 tokens: CPU tests
MEDIUM_SIZE = (4, 64, 64)    # 4,096 tokens (4 frames)
LONG_SIZE = (16, 64, 64)     # 16,384 tokens: trained and reported
LONGER_SIZE = (32, 64, 64)   # 32,768 tokens: recall only (the model never saw it in training)

SIZE_NAMES = {SHORT_SIZE: "testbed-320", MEDIUM_SIZE: "testbed-4k", (8, 32, 32): "testbed-2k", LONG_SIZE: "testbed-16k", LONGER_SIZE: "testbed-32k"}


def tokens_of(size) -> int:
    t, h, w = size
    return t * ((h + 1) // 2) * ((w + 1) // 2)


def size_name(size) -> str:
    return SIZE_NAMES.get(tuple(size), f"testbed-{tokens_of(size)}")


@dataclass
class TestbedConfig:
    __test__ = False  # not a pytest class

    # model (ComfyUI WanModel, I2V; heads = dim // head_dim)
    dim: int = 256
    head_dim: int = 128           # Wan's; narrower heads only in process (ComfyUI's loader assumes 128)
    ffn_dim: int = 896            # 4 layers x 896 keeps the fp16 file under 16 MiB
    num_layers: int = 4
    model_seed: int = 0
    texture: str = "plain"        # workload family of training and report requests (workload.TEXTURES)
    # Self-attention temperature: Wan normalises q and k (RMSNorm), so the logit scale is the
    # product of the two norms' gains. Trained at the base rate they stay near 1 (sharp16k after
    # 7,814 steps: 0.94-1.12 on average), which caps how peaked attention over 16k keys can get.
    qk_gain_init: float = 1.0     # initial value of the self-attention norm_q / norm_k gains
    qk_gain_lr_mult: float = 1.0  # their learning rate over the base rate
    # A penalty on self-attention entropy (attention_entropy.py): it imposes the concentration the
    # workloads alone did not produce (issue 23), so a design trained with it must say so.
    attn_entropy_weight: float = 0.0
    attn_entropy_queries: int = 128  # query rows sampled per self-attention call for the penalty

    # training
    short_size: tuple = SHORT_SIZE
    long_size: tuple = LONG_SIZE
    long_share: float = 0.8        # share of steps at the long size
    curriculum_steps: int = 0      # > 0: the long share ramps from 0 to long_share over these first steps
    batch_short: int = 16
    batch_long: int = 4
    lr: float = 6e-4
    min_lr: float = 6e-5
    weight_decay: float = 0.01
    warmup_steps: int = 100
    grad_clip: float = 1.0
    max_steps: int = 100000
    time_budget_s: float = 210.0   # wall-clock training budget (stop when reached)
    expected_steps: int = 3000     # the cosine schedule's length (min with max_steps)
    shift: float = 5.0             # flow-matching timestep shift for training
    seed: int = 1234
    autocast_bf16: bool = True
    train_templates: tuple = ("pan", "zoom", "orbit", "bounce", "fade")
    train_subjects: int = 8        # subjects 0 .. n-1
    train_layouts: int = 8         # layouts 0 .. n-1
    data_workers: int = 8
    log_every: int = 25
    val_every: int = 0             # held-out loss every this many steps and at each chunk's end (0 = off)

    # report
    block_size: int = 128
    sample_steps: int = 10
    sample_shift: float = 8.0      # ComfyUI's WAN21 sampling shift
    sample_cfg: float = 1.0        # the product path's cfg; above 1 ComfyUI runs cond and uncond in one batch
    step_buckets: tuple = ((0, 1, 2), (3, 4, 5, 6), (7, 8, 9))
    eval_templates: tuple = ()     # () = every template
    eval_layouts: tuple = (0, 1)   # target / similar requests use these (seen) layouts
    population_layouts: tuple = (2, 3)
    eval_subject_base: int = 100   # held-out subjects: targets 100+, similar sources 200+, population 300+
    densities: tuple = (0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5)
    table_density: float = 0.12
    warmup_dense_steps: int = 1    # dense steps before sparse ones in the main grid
    warmup_sweep: tuple = (0, 1, 2, 3)
    # dense-layers sweep: reused_similar masks at dense_layers_density (0 = table_density) after
    # warmup_dense_steps dense steps, with these layer sets kept dense (negative = from the end)
    dense_layers_sweep: tuple = ((), (0,), (-1,), (0, -1))
    dense_layers_density: float = 0.0
    top_p_sweep: tuple = (0.5, 0.7, 0.8, 0.9, 0.95)
    error_steps: tuple = (1, 5, 8)  # steps whose q, k, v are kept for the output-error measure
    length_sizes: tuple = (MEDIUM_SIZE, LONG_SIZE, LONGER_SIZE)
    length_sigmas: tuple = (0.95, 0.7, 0.3)
    length_targets: int = 5
    thresholds: tuple = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
    report_budget_s: float = 150.0
    seed_report: int = 7
    sample_densities: tuple = ()   # densities of the main grid that get sparse sampling runs; () = all
    sample_targets: int = 0        # targets (spread over the list) with sampling runs: grid PSNR, sweeps; 0 = all
    # step-bucket study: per-step oracle masks of a few targets, cross-step recall, bucket splits
    bucket_study_targets: int = 3  # 0 = skip the study
    bucket_study_density: float = 0.0  # 0 = table_density
    bucket_study_psnr: bool = True  # also sample each split with reused_similar masks (one batched run per target)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @property
    def num_heads(self) -> int:
        return self.dim // self.head_dim


def smoke_config() -> TestbedConfig:
    """A config a CPU runs in seconds (tests)."""
    return TestbedConfig(
        dim=128, ffn_dim=256, num_layers=2, long_size=(2, 16, 32), batch_short=2, batch_long=1,
        warmup_steps=2, max_steps=4, expected_steps=4, time_budget_s=60, train_subjects=2, train_layouts=2,
        data_workers=1, log_every=1, sample_steps=3, step_buckets=((0,), (1,), (2,)), densities=(0.3, 0.6),
        table_density=0.3, warmup_sweep=(0, 1), top_p_sweep=(0.9,), error_steps=(1,),
        length_sizes=((2, 16, 32),), length_sigmas=(0.7,), length_targets=2, thresholds=(0.5, 0.9),
        eval_templates=("pan", "zoom"), eval_layouts=(0, 1), population_layouts=(2,), block_size=64, report_budget_s=120, lr=2e-3,
        bucket_study_targets=2,
    )


CPU_SIZE = (8, 32, 32)  # 2,048 tokens = 32 blocks of 64 per side


def cpu2k_config() -> TestbedConfig:
    """The report of the committed checkpoint on a 2-core CPU (about 20 minutes) at 2,048 tokens.

    Measured first on the shared 2-core CPU: one dense recording run (10 steps, block mass
    every call) takes 29 s at 8x32x32 (2,048 tokens), one sparse sampling run 9 s; 16x32x32
    (4,096 tokens, block 128) would be about 4x that. So: 2 templates x 2 layouts (4 targets,
    recall on all of them), sampling runs (PSNR/SSIM) on 2 of them, fewer densities and sweep
    points than ``full``.
    """
    return TestbedConfig(
        long_size=CPU_SIZE, block_size=64, eval_templates=("pan", "orbit"), eval_layouts=(0, 1),
        population_layouts=(2,), densities=(0.05, 0.12, 0.2, 0.3, 0.5), sample_densities=(0.12, 0.3, 0.5),
        sample_targets=2, table_density=0.12, error_steps=(1, 5), length_sizes=(), warmup_sweep=(0, 1, 2, 3),
        top_p_sweep=(0.7, 0.9, 0.95), report_budget_s=3600.0, bucket_study_targets=2,
    )


SHARP_SIZE = (16, 64, 64)  # 16,384 tokens = 128 blocks of 128 per side


def sharp16k_config() -> TestbedConfig:
    """The sharp testbed (issue 16), for an H200 in chunks of under 9 minutes (``train --resume``).

    The "detailed" workload (later frames copy white-noise texture from the first frame), 3 heads
    of 128 over 6 layers. Size: WanModel's fixed parts (text projection 4096 x dim, CLIP projector,
    time embedding) are 5.07 M parameters at dim 384 and each block is 1.48 M + 2 * dim * ffn_dim,
    so dim 384 / ffn 512 / 6 layers = 16.34 M parameters = 31.2 MiB in fp16 (the file: 31.2 MiB) (dim 512 with 4 heads
    fits 32 MiB only at 3 layers: its fixed part alone is 6.7 M). ``test_testbed_sharp`` checks it.
    Steps: the committed 16k checkpoint (dim 256, 4 layers, batch 4) ran 0.115 s a step on the H200;
    this one has about the same attention work per step (dim x layers x batch 4,608 against 4,096), so
    10,000 steps are about three 450 s chunks.
    """
    return TestbedConfig(
        dim=384, ffn_dim=512, num_layers=6, texture="detailed", short_size=(5, 32, 32), long_size=SHARP_SIZE,
        long_share=0.7, batch_short=16, batch_long=2, lr=5e-4, min_lr=5e-5, warmup_steps=200,
        max_steps=10000, expected_steps=10000, time_budget_s=450.0, train_subjects=16, train_layouts=8, log_every=25,
        block_size=128, eval_layouts=(0, 1), population_layouts=(2, 3), table_density=0.15,
    )


def tiny_sharp_config() -> TestbedConfig:
    """The sharp testbed at CPU-test size: same workload family and code paths, seconds per run."""
    return replace(smoke_config(), texture="detailed", short_size=(3, 16, 16), long_size=(3, 16, 32),
                   long_share=0.5, max_steps=6, expected_steps=6, batch_short=2, batch_long=1,
                   block_size=32, table_density=0.3, sample_steps=4, step_buckets=((0,), (1,), (2, 3)))


# --------------------------------------------------------------------------------------------
# Probe candidates (issue 23): each changes sharp16k in one way (the combination in two), so a
# short probe run (``tests.testbed.probe``) tells which change concentrates attention.
# --------------------------------------------------------------------------------------------

WIDE_SIZE = (16, 32, 128)      # 16,384 tokens in rows of 64 (a 128-token block = 2 rows; Wan 480p: 52)
FRAMES32_SIZE = (32, 64, 64)   # 32,768 tokens: 32 frames of 1,024 tokens (8 blocks a frame)


def probe_heads8x48_config() -> TestbedConfig:
    """8 heads of 48 at sharp16k's width and depth (same parameter count): do more, narrower heads
    specialise (one job a head) where 3 heads of 128 each do several?"""
    return replace(sharp16k_config(), head_dim=48)


def probe_heads8x64_config() -> TestbedConfig:
    """8 heads of 64 over 4 layers at width 512: more heads per layer, fewer layers (Wan: 40 x 128)."""
    return replace(sharp16k_config(), dim=512, head_dim=64, ffn_dim=1024, num_layers=4)


def probe_heads6x128_config() -> TestbedConfig:
    """6 heads of 128 over 3 layers at width 768: more heads of Wan's own width (ComfyUI's loader
    derives heads as dim // 128, so only 128-wide heads reach the product path)."""
    return replace(sharp16k_config(), dim=768, ffn_dim=1024, num_layers=3)


def probe_wide_config() -> TestbedConfig:
    """Latents 32 x 128 (rows of 64 tokens) instead of 64 x 64 (rows of 32): a 128-token block is a
    2-row patch, not a 4-row strip, so a local neighbourhood covers fewer blocks."""
    return replace(sharp16k_config(), long_size=WIDE_SIZE, short_size=(5, 16, 64))


def probe_multi_config() -> TestbedConfig:
    """The "multi" workload: three textured objects moving differently (one over twice the template's
    path, wrapping round the frame), occluding each other and hidden by a bar they pass behind, so
    a later frame must look up exact detail far away in the first frame."""
    return replace(sharp16k_config(), texture="multi")


def probe_frames32_config() -> TestbedConfig:
    """32 frames at 64 x 64 (32,768 tokens): a frame is 8 of 256 key blocks, so spatial structure
    (one frame) and temporal structure (one place in every frame) each fill a small share."""
    return replace(sharp16k_config(), long_size=FRAMES32_SIZE, batch_long=1)


def probe_curriculum_config() -> TestbedConfig:
    """Short clips first: 4 frames at full 64 x 64 size, the long (16-frame) share ramping from 0 to 0.7
    over the first 600 steps, so spatial look-ups are learnt before temporal ones."""
    return replace(sharp16k_config(), short_size=(4, 64, 64), batch_short=8, curriculum_steps=600)


def probe_combo_config() -> TestbedConfig:
    """More heads, wide latents and the multi workload together."""
    return replace(probe_heads8x64_config(), long_size=WIDE_SIZE, short_size=(5, 16, 64), texture="multi")


def probe_qk_lr10_config() -> TestbedConfig:
    """sharp16k with the self-attention q/k norm gains (the temperature) trained 10x faster."""
    return replace(sharp16k_config(), qk_gain_lr_mult=10.0)


def probe_qk_lr30_config() -> TestbedConfig:
    """sharp16k with the self-attention q/k norm gains trained 30x faster."""
    return replace(sharp16k_config(), qk_gain_lr_mult=30.0)


def probe_qk_init2_config() -> TestbedConfig:
    """sharp16k with the q/k norm gains starting at 1.5 (logits x 2.25) and trained 10x faster."""
    return replace(sharp16k_config(), qk_gain_init=1.5, qk_gain_lr_mult=10.0)


def probe_qk_heads6x128_config() -> TestbedConfig:
    """6 heads of Wan's width over 3 layers with the q/k norm gains trained 10x faster."""
    return replace(probe_heads6x128_config(), qk_gain_lr_mult=10.0)


def probe_shift1_config() -> TestbedConfig:
    """sharp16k trained at flow shift 1 instead of 5: as many low-noise as high-noise training steps.
    At shift 5 most steps are noisy, where the denoiser can lean on broad context; the exact
    texture copies that need peaked attention dominate the loss only at low noise (sharp16k's
    per-step sharpness rises from 0.40 at the first sampling step to 0.52 at the last)."""
    return replace(sharp16k_config(), shift=1.0)


def probe_shift05_config() -> TestbedConfig:
    """Flow shift 0.5: most training steps at low noise (probe d: shift 1 led sharp16k at equal steps)."""
    return replace(sharp16k_config(), shift=0.5)


def probe_shift1_multi_config() -> TestbedConfig:
    """Shift 1 with the multi workload (far look-ups, occlusion): the two levers that led or tied sharp16k."""
    return replace(sharp16k_config(), shift=1.0, texture="multi")


def probe_shift025_config() -> TestbedConfig:
    """Flow shift 0.25: probes d-e found the lower the training shift, the sharper (5: 0.44, 1: 0.50, 0.5: 0.54)."""
    return replace(sharp16k_config(), shift=0.25)


def probe_shift05_curriculum_config() -> TestbedConfig:
    """Shift 0.5 with the short-clips-first curriculum (the curriculum led early: 0.459 at step 400)."""
    return replace(probe_curriculum_config(), shift=0.5)


def probe_shift05_entropy_config() -> TestbedConfig:
    """Shift 0.5 with a light entropy penalty: shift 0.5 trained on levelled off near 0.5 (0.486 at step 5,883)."""
    return replace(probe_shift05_config(), attn_entropy_weight=0.02)


def probe_shift05_entropy_strong_config() -> TestbedConfig:
    """Shift 0.5 with a penalty five times stronger."""
    return replace(probe_shift05_config(), attn_entropy_weight=0.1)


def probe_shift05_heads6x128_config() -> TestbedConfig:
    """Shift 0.5 with 6 heads of 128 over 3 layers: fewer of the diffuse early layers, more heads each."""
    return replace(probe_heads6x128_config(), shift=0.5)


def entropy16k_config() -> TestbedConfig:
    """The concentrated testbed (issue 23, probe h): ``probe_shift05_entropy`` trained without the
    ``bounce`` family, which stays held out for the quality table. Its attention is concentrated by
    the entropy penalty, not by the workload alone: the README's quality section says so."""
    return replace(probe_shift05_entropy_config(), train_templates=("pan", "zoom", "orbit", "fade"), val_every=500)


def tiny_probe_heads_config() -> TestbedConfig:
    """A CPU-test probe candidate: tiny_sharp with 4 heads of 32 and the multi workload."""
    return replace(tiny_sharp_config(), head_dim=32, texture="multi")


PROBE_CANDIDATES = {"sharp16k": sharp16k_config, "probe_heads8x48": probe_heads8x48_config,
                    "probe_heads8x64": probe_heads8x64_config, "probe_heads6x128": probe_heads6x128_config,
                    "probe_wide": probe_wide_config,
                    "probe_multi": probe_multi_config, "probe_frames32": probe_frames32_config,
                    "probe_curriculum": probe_curriculum_config, "probe_combo": probe_combo_config,
                    "probe_qk_lr10": probe_qk_lr10_config, "probe_qk_lr30": probe_qk_lr30_config,
                    "probe_qk_init2": probe_qk_init2_config, "probe_qk_heads6x128": probe_qk_heads6x128_config,
                    "probe_shift1": probe_shift1_config, "probe_shift05": probe_shift05_config,
                    "probe_shift1_multi": probe_shift1_multi_config, "probe_shift025": probe_shift025_config,
                    "probe_shift05_curriculum": probe_shift05_curriculum_config,
                    "probe_shift05_entropy": probe_shift05_entropy_config,
                    "probe_shift05_entropy_strong": probe_shift05_entropy_strong_config,
                    "probe_shift05_heads6x128": probe_shift05_heads6x128_config,
                    "tiny_sharp": tiny_sharp_config, "tiny_probe_heads": tiny_probe_heads_config}

PRESETS = {"full": TestbedConfig, "smoke": smoke_config, "cpu2k": cpu2k_config, "sharp16k": sharp16k_config,
           "entropy16k": entropy16k_config,
           "tiny_sharp": tiny_sharp_config, **PROBE_CANDIDATES}


def _parse_value(text: str, current):
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, (int, float, str)) and not isinstance(current, bool):
        return type(current)(text)
    return _tuplify(json.loads(text))


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def make_config(preset: str = "full", overrides: Optional[list] = None) -> TestbedConfig:
    return config_with_overrides(PRESETS[preset](), overrides)


def with_overrides(settings, overrides: Optional[list] = None, what: str = "config field"):
    """A copy of the dataclass ``settings`` with ``NAME=VALUE`` items applied, each value parsed as
    its field's current type (bools from 1/true/yes, tuples from JSON lists)."""
    known = {f.name for f in fields(settings)}
    for item in overrides or []:
        name, _, text = item.partition("=")
        if name not in known:
            raise SystemExit(f"unknown {what} {name!r}")
        settings = replace(settings, **{name: _parse_value(text, getattr(settings, name))})
    return settings


def config_with_overrides(config: TestbedConfig, overrides: Optional[list] = None) -> TestbedConfig:
    return with_overrides(config, overrides)


def config_from_dict(data: dict) -> TestbedConfig:
    known = {f.name for f in fields(TestbedConfig)}
    return TestbedConfig(**{k: _tuplify(v) for k, v in data.items() if k in known})
