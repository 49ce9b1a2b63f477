"""`import dsv4ops` is cheap: no triton, no cutlass, no transformers, no CUDA, no compiled extension."""

import subprocess
import sys

BLOCKER = """
import builtins, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name.split(".")[0] in ("triton", "cutlass", "cuda", "tvm_ffi") or name.startswith("dsv4ops._C"):
        raise ImportError(f"blocked import of {name}")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
import torch
import dsv4ops
from dsv4ops import DSV4AttentionConfig, DeepseekV4Attention
layer = DeepseekV4Attention(DSV4AttentionConfig.tiny(), 1)
x = torch.randn(1, 9, 256)
assert layer(x).shape == (1, 9, 256)
assert not torch.cuda.is_initialized()
print("ok", [m for m in sys.modules if m.split(".")[0] in ("triton", "cutlass", "transformers")])
"""


def test_import_needs_no_gpu_triton_or_cutlass():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"
