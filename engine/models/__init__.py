"""Model classes by architecture. All four supported families share one decoder."""

from engine.config import SUPPORTED_ARCHITECTURES
from engine.models.llama import LlamaModel

MODEL_CLASSES = {arch: LlamaModel for arch in SUPPORTED_ARCHITECTURES}

__all__ = ["MODEL_CLASSES", "LlamaModel"]
