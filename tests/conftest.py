"""Shared fixtures. On a machine without CUDA, Triton kernels run in the interpreter: the variable
is read when a kernel is decorated, so it is set before any dsv4ops Triton module is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk cache key omits ATEN_CPU_CAPABILITY: a CPU kernel cached by a run with AVX-512
# code fails to compile in a run with ATEN_CPU_CAPABILITY=default ("'at::vec' has not been declared").
# Runs with a capability override get a cache of their own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
