"""Standalone CLIP image encoder (open_clip) for API-mode tools that pre-fill a bank.

Weights come from a local file only; nothing is downloaded. open_clip is imported here
lazily, so the rest of the bank works without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import BankError


class ClipImageEncoder:
    """Encode PIL images or ``[B, 3, H, W]`` tensors to CLIP image embeddings.

    :param model: an open_clip model
    :param preprocess: its image transform
    """

    def __init__(self, model, preprocess):
        self.model, self.preprocess = model.eval(), preprocess

    @classmethod
    def from_file(cls, weights_path, arch: str, device: str = "cpu") -> "ClipImageEncoder":
        """Build ``arch`` without pretrained weights and load ``weights_path`` into it.

        :param weights_path: local ``.safetensors`` or torch ``.pt``/``.bin`` state dict
        :param arch: open_clip model name, e.g. ``"ViT-H-14"`` (Wan's CLIP-vision is ViT-H/14)
        :param device: torch device
        :raises BankError: open_clip missing, file missing, or weights that do not fit ``arch``
        """
        try:
            import open_clip
        except ImportError as exc:
            raise BankError("The CLIP encoder needs open_clip: `pip install open_clip_torch`.") from exc
        path = Path(weights_path)
        if not path.is_file():
            raise BankError(f"No CLIP weights at {path}; pass a local file (no downloads).")
        model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=None)
        try:
            model.load_state_dict(_read_state(path), strict=True)
        except RuntimeError as exc:
            raise BankError(f"{path} does not fit open_clip architecture {arch!r}: "
                            f"{str(exc).splitlines()[0]}; pass the matching arch.") from exc
        return cls(model.to(device), preprocess)

    def encode(self, images) -> np.ndarray:
        """Image embeddings ``[B, D]`` float32 (feed one row to ``build_signature(clip_vision=)``).

        :param images: a PIL image, a list of them, or a preprocessed ``[B, 3, H, W]`` tensor
        """
        import torch

        if not hasattr(images, "shape"):
            images = images if isinstance(images, (list, tuple)) else [images]
            images = torch.stack([self.preprocess(im) for im in images])
        device = next(self.model.parameters()).device
        with torch.no_grad():
            return self.model.encode_image(images.to(device)).float().cpu().numpy()


def _read_state(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle objects
    return state.get("state_dict", state)
