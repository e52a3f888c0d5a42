"""Plain records stored with every entry: the latent layout and the sampling schedule."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .errors import BankIncompatible

DEFAULT_BUCKET_EDGES = (0.0, 0.25, 0.6, 1.0)  # 3 buckets: attention changes most early on


def default_step_buckets(steps: int, edges=DEFAULT_BUCKET_EDGES) -> list[tuple[int, int]]:
    """Split ``steps`` denoising steps into the default 3 step buckets (25 %, 35 %, 40 %).

    :param steps: number of sampling steps
    :param edges: bucket edges as fractions of ``steps``, from 0.0 to 1.0
    """
    cuts = sorted({min(steps, max(0, round(e * steps))) for e in edges})
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass(frozen=True)
class LatentLayout:
    """Token grid of the video self-attention and how it is cut into blocks.

    :param grid: (T, H, W) token grid after patchify (Wan 720p 81 frames: (21, 45, 80))
    :param token_order: order of tokens in the sequence, ``"thw"`` for Wan's raster order
    :param block_size: (query block, key block) in tokens
    """

    grid: tuple[int, int, int]
    token_order: str = "thw"
    block_size: tuple[int, int] = (128, 128)

    def __post_init__(self):
        object.__setattr__(self, "grid", tuple(int(x) for x in self.grid))
        object.__setattr__(self, "block_size", tuple(int(x) for x in self.block_size))

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def blocks(self) -> tuple[int, int]:
        """(nq, nk): number of query and key blocks."""
        n = self.tokens
        return -(-n // self.block_size[0]), -(-n // self.block_size[1])

    def to_dict(self) -> dict:
        return {"grid": list(self.grid), "token_order": self.token_order,
                "block_size": list(self.block_size)}


@dataclass(frozen=True)
class Schedule:
    """The sampling schedule masks were recorded under, and the step buckets they cover.

    :param steps: number of sampling steps
    :param sampler: sampler name, e.g. ``"uni_pc"``
    :param scheduler: scheduler name, e.g. ``"simple"``
    :param shift: the model sampling shift
    :param step_buckets: half-open step ranges ``[(start, end), ...]``, one mask set each;
        ``None`` picks :func:`default_step_buckets`
    """

    steps: int
    sampler: str = ""
    scheduler: str = ""
    shift: float = 0.0
    step_buckets: list = field(default=None)

    def __post_init__(self):
        buckets = self.step_buckets or default_step_buckets(self.steps)
        buckets = [(int(a), int(b)) for a, b in buckets]
        for (a, b), nxt in zip(buckets, buckets[1:] + [None]):
            if b <= a or (nxt is not None and nxt[0] != b):
                raise BankIncompatible(
                    f"Step buckets {buckets} must be contiguous, increasing ranges; "
                    "pass e.g. [(0, 10), (10, 25), (25, 40)] or leave step_buckets out.")
        object.__setattr__(self, "step_buckets", buckets)
        object.__setattr__(self, "shift", float(self.shift))

    def bucket_for_step(self, step: int) -> int:
        """Index of the bucket that covers ``step`` (steps past the end use the last one)."""
        for i, (a, b) in enumerate(self.step_buckets):
            if a <= step < b:
                return i
        return len(self.step_buckets) - 1 if step >= self.step_buckets[-1][1] else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step_buckets"] = [list(b) for b in self.step_buckets]
        return d
