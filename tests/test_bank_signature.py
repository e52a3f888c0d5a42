"""Request signatures, model fingerprints and the standalone open_clip encoder."""

import json

import numpy as np
import pytest
import torch
from bank_fixtures import toy_state_dict

from chorus_core.bank import BankError, build_signature, fingerprint_model
from chorus_core.bank.signature import DIM


def test_signature_components_are_fixed_length_unit_vectors():
    rng = np.random.default_rng(0)
    sig = build_signature(clip_vision=torch.randn(1, 257, 1280), text=torch.randn(1, 30, 4096),
                          start_latent=torch.randn(1, 16, 21, 90, 160))
    assert {k: (v.shape, v.dtype) for k, v in sig.components.items()} == {
        c: ((DIM,), np.float32) for c in ("clip", "text", "layout")}
    assert [round(float(np.linalg.norm(v)), 5) for v in sig.components.values()] == [1.0] * 3
    embeds = build_signature(clip_vision=rng.standard_normal((1, 1024)))
    assert sorted(embeds.components) == ["clip"]


def test_signature_is_deterministic_and_accepts_comfy_shapes():
    clip = torch.randn(1, 257, 1280)
    text = torch.randn(1, 7, 4096)
    padded = torch.cat([text, torch.zeros(1, 505, 4096)], dim=1)  # zero padding is ignored

    class VisionOutput:  # what ComfyUI's CLIP-vision node returns carries these attributes
        penultimate_hidden_states = clip
        image_embeds = torch.randn(1, 1024)

    a = build_signature(clip_vision=clip, text=text)
    b = build_signature(clip_vision=VisionOutput(), text=[[padded, {"pooled_output": None}]])
    assert a.similarity(b)[0] == pytest.approx(1.0, abs=1e-6)


def test_layout_depends_on_where_the_subject_is():
    latent = torch.zeros(16, 3, 32, 32)
    left, right, left2 = latent.clone(), latent.clone(), latent.clone()
    left[:, 0, 8:24, 2:12] = 1.0
    left2[:, 0, 9:23, 3:13] = 1.0
    right[:, 0, 8:24, 20:30] = 1.0
    lay = lambda x: build_signature(start_latent=x).components["layout"]  # noqa: E731
    assert float(lay(left) @ lay(left2)) > 0.9 > float(lay(left) @ lay(right))


def test_hidden_states_and_embeds_never_look_alike():
    x = np.ones((1, 1024), np.float32)
    a = build_signature(clip_vision=x)
    b = build_signature(clip_vision=np.ones((1, 2, 512), np.float32))
    assert abs(a.similarity(b)[0]) < 0.3


def test_signature_needs_a_component():
    with pytest.raises(ValueError, match="at least one of"):
        build_signature()


def test_fingerprint_reads_shapes_and_tells_checkpoints_apart():
    state = toy_state_dict(dim=256, layers=3, seed=0)
    fp = fingerprint_model(state)
    assert {k: v for k, v in fp.to_dict().items() if k != "digest"} == {
        "architecture": "wan2.1", "dim": 256, "layers": 3, "heads": 2, "in_dim": 36}
    prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    assert fingerprint_model(prefixed) == fp
    assert fingerprint_model({k: v.bfloat16() for k, v in state.items()}) == fp
    assert fingerprint_model(toy_state_dict(dim=256, layers=3, seed=1)).digest != fp.digest
    module = torch.nn.Module()
    module.state_dict = lambda: {f"diffusion_model.{k}": v for k, v in state.items()}
    assert fingerprint_model(module) == fp
    with pytest.raises(BankError, match="Pass a Wan 2.1 diffusion model"):
        fingerprint_model({"foo": torch.zeros(1)})


TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8,
                            "head_width": 32},
             "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2,
                          "layers": 1}}


def test_clip_encoder_loads_local_weights_only(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    from PIL import Image
    from safetensors.torch import save_file

    from chorus_core.bank import ClipImageEncoder
    (tmp_path / "chorus-tiny.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(tmp_path)
    model = open_clip.create_model("chorus-tiny", pretrained=None)
    weights = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    encoder = ClipImageEncoder.from_file(weights, "chorus-tiny")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), np.uint8))
    emb = encoder.encode([image, image])
    with torch.no_grad():
        want = model.eval().encode_image(torch.stack([encoder.preprocess(image)] * 2)).numpy()
    assert emb.shape == (2, 32) and np.allclose(emb, want, atol=1e-5)
    assert sorted(build_signature(clip_vision=emb[:1]).components) == ["clip"]
    with pytest.raises(BankError, match="no downloads"):
        ClipImageEncoder.from_file(tmp_path / "missing.safetensors", "chorus-tiny")
    with pytest.raises(BankError, match="pass the matching arch"):
        ClipImageEncoder.from_file(weights, "RN50")
