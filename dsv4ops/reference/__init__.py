"""The oracle: DeepSeek-V4 attention in plain PyTorch (spec section 3) and its numerics modes."""

from dsv4ops.reference.layer import attention, compress, indexer_scores, indexer_topk
from dsv4ops.reference.numerics import Numerics

__all__ = ["Numerics", "attention", "compress", "indexer_scores", "indexer_topk"]
