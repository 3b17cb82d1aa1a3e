"""Training memory: predict it (`estimate`), and measure it from the tensors (`measure`)."""

from gpulab.memory.calculator import (PARTS, ActivationTerms, MemoryEstimate, TrainingSetup, activation_bytes,
                                     activation_terms, estimate, kv_cache_bytes)
from gpulab.memory.shapes import KNOWN_SHAPES, ModelShape

__all__ = ["PARTS", "KNOWN_SHAPES", "ActivationTerms", "MemoryEstimate", "ModelShape", "TrainingSetup",
           "activation_bytes", "activation_terms", "estimate", "kv_cache_bytes"]
