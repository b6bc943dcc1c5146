"""Attention over the paged KV cache: metadata built once per step, and the backends that use it."""

from mmserve.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
