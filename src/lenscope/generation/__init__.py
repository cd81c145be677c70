"""Explain what the model writes: generate a continuation and attribute every generated token, from one pass
(:func:`generate` -> :class:`Generation`)."""

from .result import Generation
from .run import decode, generate

__all__ = ["Generation", "decode", "generate"]
