"""The model definition, one for every architecture (colibri_stream/loader.py loads it onto a device)."""

from ..batch import ForwardBatch
from .paged_kv import PagedKVCache
from .transformer import MoETransformer

__all__ = ["ForwardBatch", "MoETransformer", "PagedKVCache"]
