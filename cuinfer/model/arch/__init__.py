"""Architectures as data: one module per family (llama, qwen3, phi3, gemma), each an `Arch` record
(base.py); `ARCHES` maps every Hugging Face architecture name to its record."""
from . import gemma, llama, phi3, qwen3
from .base import FULL, HEAD_NORMS, LINEAR_FIELDS, NORM_FIELDS, SLIDING, Arch

ARCHES = {name: arch for family in (llama, qwen3, phi3, gemma) for arch in family.ARCHES for name in arch.names}

__all__ = ["ARCHES", "FULL", "HEAD_NORMS", "LINEAR_FIELDS", "NORM_FIELDS", "SLIDING", "Arch"]
