"""The model definition (one for every architecture) and its loader."""

from .batch import ForwardBatch
from .paged_kv import PagedKVCache
from .transformer import MoETransformer, load_model

__all__ = ["ForwardBatch", "MoETransformer", "PagedKVCache", "load_model"]
