"""Plain records stored with every entry: the latent layout and the sampling schedule."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .errors import BankIncompatible

DEFAULT_BUCKET_EDGES = (0.0, 0.25, 0.6, 1.0)  # 3 buckets: attention changes most early on
SIGMA_REL_TOLERANCE = 1e-4  # sigmas pass through float32 (ComfyUI) and JSON (the bank)


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
    :param sigmas: the recording run's sigma schedule as ComfyUI hands it to the sampler
        (``steps + 1`` finite, non-negative, non-increasing values, the last usually 0), so
        masks can be addressed by noise level (:meth:`bucket_for_sigma`); ``None`` when
        unknown (entries recorded before sigmas were stored)
    """

    steps: int
    sampler: str = ""
    scheduler: str = ""
    shift: float = 0.0
    step_buckets: list = field(default=None)
    sigmas: tuple | None = None

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
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", _checked_sigmas(self.sigmas, self.steps, buckets))

    def bucket_start_sigmas(self) -> tuple | None:
        """The sigma at the first step of each step bucket (None when sigmas are unknown)."""
        if self.sigmas is None:
            return None
        return tuple(self.sigmas[a] for a, _ in self.step_buckets)

    def bucket_for_sigma(self, sigma: float) -> int:
        """Index of the bucket serving a model call at noise level ``sigma``: the last bucket
        whose start sigma is at or above ``sigma`` (relative tolerance
        :data:`SIGMA_REL_TOLERANCE`, as sigmas travel through float32 and JSON); 0 when
        ``sigma`` is above every start sigma (a run that starts noisier than the recording).

        :raises ValueError: the schedule has no sigmas (address buckets by step instead), or
            ``sigma`` is NaN
        """
        starts = self.bucket_start_sigmas()
        if starts is None:
            raise ValueError("this schedule has no sigmas (recorded before they were stored); "
                             "address its buckets by step with bucket_for_step")
        sigma = float(sigma)
        if math.isnan(sigma):
            raise ValueError("sigma is NaN; pass the sampler's current noise level")
        found = 0
        for i, start in enumerate(starts):
            if start >= sigma or math.isclose(start, sigma, rel_tol=SIGMA_REL_TOLERANCE):
                found = i
        return found

    def bucket_for_step(self, step: int) -> int:
        """Index of the bucket that covers ``step`` (steps past the end use the last one)."""
        for i, (a, b) in enumerate(self.step_buckets):
            if a <= step < b:
                return i
        return len(self.step_buckets) - 1 if step >= self.step_buckets[-1][1] else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step_buckets"] = [list(b) for b in self.step_buckets]
        d["sigmas"] = None if self.sigmas is None else list(self.sigmas)
        return d


def _checked_sigmas(sigmas, steps: int, buckets: list) -> tuple:
    """``sigmas`` as a tuple of Python floats, or BankIncompatible saying what to pass."""
    hint = (f"pass the {steps + 1} sigmas of the {steps}-step recording run as the sampler "
            "received them (finite, >= 0, non-increasing, e.g. [14.6, ..., 0.03, 0.0]), or "
            "sigmas=None when they are unknown")
    if isinstance(sigmas, (str, bytes)):
        raise BankIncompatible(f"Schedule sigmas must be a sequence of numbers, not text; {hint}.")
    try:
        values = tuple(_to_float(x) for x in sigmas)
    except (TypeError, ValueError, OverflowError):
        raise BankIncompatible(f"Schedule sigmas must be a sequence of numbers; {hint}.") from None
    if len(values) != steps + 1:
        raise BankIncompatible(f"Schedule sigmas hold {len(values)} values, a {steps}-step "
                               f"schedule has {steps + 1}; {hint}.")
    bad = next((i for i, x in enumerate(values) if not math.isfinite(x) or x < 0), None)
    if bad is not None:
        raise BankIncompatible(f"Schedule sigma {bad} is {values[bad]!r}; {hint}.")
    rising = next((i for i in range(1, len(values)) if values[i] > values[i - 1]), None)
    if rising is not None:
        raise BankIncompatible(f"Schedule sigmas rise at step {rising} ({values[rising - 1]!r} "
                               f"then {values[rising]!r}); {hint}.")
    if buckets[0][0] < 0 or buckets[-1][1] > steps:
        raise BankIncompatible(f"Step buckets {buckets} reach outside the {steps} steps the "
                               "sigmas cover; pass buckets within [0, steps].")
    return values


def _to_float(value) -> float:
    if isinstance(value, (str, bytes, bool)):
        raise TypeError("not a number")
    return float(value)
