"""dsv4ops: DeepSeek-V4 and V4.1 attention and router operators for PyTorch.

Importing registers the `dsv4::` ops with their reference kernels and fakes; it touches no GPU and
imports neither triton nor cutlass (GPU backends load on first use).
"""

from dsv4ops import ops  # noqa: F401  (defines the dsv4:: ops)
from dsv4ops import _meta  # noqa: F401  (registers their fakes)
from dsv4ops import _autograd
from dsv4ops import backends  # noqa: F401  (binds the lazy CUDA kernels; imports no triton)
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers import DeepseekV4Attention
from dsv4ops.layers_v41 import DeepseekV41Attention, DeepseekV41AttentionStack
from dsv4ops.quant.formats import CacheFormats
from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router
from dsv4ops.warmup import warmup

_autograd.install_all()  # a backward through any dsv4:: op raises

__all__ = [
    "CacheFormats", "DSV41AttentionConfig", "DSV4AttentionConfig", "DeepseekV41Attention",
    "DeepseekV41AttentionStack", "DeepseekV4Attention", "DeepseekV4HashRouter", "DeepseekV4Router", "warmup",
]

# The names CacheFormats replaced: the error names it. An ImportError, since `from dsv4ops import
# Numerics` turns an AttributeError into "cannot import name" and drops the message.
_RENAMED = {"Numerics": "dsv4ops.CacheFormats (the pools' row formats; the oracle's modes: dsv4ops.reference.Numerics)",
            "V41Numerics": "dsv4ops.CacheFormats (CacheFormats.v41() is the QAT default)"}


def __getattr__(name):
    if name in _RENAMED:
        raise ImportError(f"dsv4ops.{name} was replaced by {_RENAMED[name]}")
    raise AttributeError(f"module 'dsv4ops' has no attribute {name!r}")
