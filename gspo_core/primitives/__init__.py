"""Training and sampling primitives (Tinker-shaped): the core every training surface is a loop over."""

from gspo_core.primitives.sampling import SamplingSession
from gspo_core.primitives.training import TrainingSession
from gspo_core.primitives.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    SampledSequence,
    SamplingParams,
)

__all__ = [
    "AdamParams",
    "Datum",
    "ForwardBackwardOutput",
    "LoraSpec",
    "SampledSequence",
    "SamplingParams",
    "SamplingSession",
    "TrainingSession",
]
