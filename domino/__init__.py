"""Domino: parallel drafters (DFlash-style backbone + a light sequential head) for lossless
speculative decoding of Hugging Face causal LMs. Plain PyTorch + Transformers; no Ray here."""

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.sampling import SamplingParams
from domino.target import Target

__all__ = ["Drafter", "DrafterConfig", "DominoError", "SamplingParams", "Target"]
