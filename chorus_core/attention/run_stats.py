"""What a sparse run did, per layer and per step: read by the report, the web view and tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional



@dataclass
class LayerStats:
    """Self-attention calls of one layer: how many ran sparse, how many dense, at what density."""

    sparse_calls: int = 0
    dense_calls: int = 0
    density_sum: float = 0.0  # over sparse calls

    def add(self, density: Optional[float]) -> None:
        """Count one call; ``density`` None means it ran dense."""
        if density is None:
            self.dense_calls += 1
        else:
            self.sparse_calls += 1
            self.density_sum += density

    @property
    def mean_density(self) -> Optional[float]:
        """Mean share of blocks kept by the sparse calls; None when none ran sparse."""
        return self.density_sum / self.sparse_calls if self.sparse_calls else None

    @property
    def effective_density(self) -> Optional[float]:
        """Mean share of attention computed over all calls (a dense call counts as 1)."""
        calls = self.sparse_calls + self.dense_calls
        return (self.density_sum + self.dense_calls) / calls if calls else None

    def as_dict(self) -> dict:
        return {
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "mean_density": self.mean_density,
            "effective_density": self.effective_density,
        }


@dataclass
class StepStats:
    """One sampling step: per-layer calls and the wall time from its first model call to the next step's."""

    step: int
    layers: dict[int, LayerStats] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"step": self.step, "seconds": self.seconds,
                "layers": {layer: s.as_dict() for layer, s in sorted(self.layers.items())}}


@dataclass
class RunStats:
    """One sampling run (readable while it runs, and after)."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    steps: list[StepStats] = field(default_factory=list)  # closed steps, in order
    scheduled_steps: int = 0  # len(sample_sigmas) - 1
    seconds: float = 0.0
    finished: bool = False  # sampling returned normally
    warnings: list[str] = field(default_factory=list)  # why some calls fell back to dense
    backend: Optional[str] = None  # the block-sparse kernel backend and why it was chosen
    dense_backend: Optional[str] = None  # what the dense self-attention calls ran on, and why
    batch: Optional[int] = None  # the largest model-call batch (2: cond and uncond together)

    @property
    def total_steps(self) -> int:
        return len(self.steps)

    @property
    def sparse_calls(self) -> int:
        return sum(s.sparse_calls for s in self.layers.values())

    @property
    def dense_calls(self) -> int:
        return sum(s.dense_calls for s in self.layers.values())

    def step_timings(self) -> dict:
        """Mean wall time of this run's all-dense steps and of its steps with sparse calls, each where
        the run had such steps: together, the run's own measure of what sparse attention saved (the
        dense steps are usually the warm-up, so they also carry one-time costs; a hit sparse from its
        first step has none to compare with)."""
        dense = [s.seconds for s in self.steps if not any(layer.sparse_calls for layer in s.layers.values())]
        sparse = [s.seconds for s in self.steps if any(layer.sparse_calls for layer in s.layers.values())]
        means = {"dense_step_s": dense, "sparse_step_s": sparse}
        return {key: round(sum(v) / len(v), 4) for key, v in means.items() if v}

    def as_dict(self) -> dict:
        return {
            "total_steps": self.total_steps,
            "scheduled_steps": self.scheduled_steps,
            "seconds": self.seconds,
            "finished": self.finished,
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "layers": {layer: s.as_dict() for layer, s in sorted(self.layers.items())},
            "warnings": list(self.warnings),
            "backend": self.backend,
            "dense_backend": self.dense_backend,
        }


StepCallback = Callable[[StepStats, RunStats], Any]
