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
from dsv4ops.reference.numerics import Numerics
from dsv4ops.reference.v41 import V41Numerics
from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router
from dsv4ops.warmup import warmup

_autograd.install_all()  # a backward through any dsv4:: op raises

__all__ = [
    "DSV41AttentionConfig", "DSV4AttentionConfig", "DeepseekV41Attention", "DeepseekV41AttentionStack",
    "DeepseekV4Attention", "DeepseekV4HashRouter", "DeepseekV4Router", "Numerics", "V41Numerics", "warmup",
]
