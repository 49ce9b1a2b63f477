"""Shared fixtures. On a machine without CUDA, Triton kernels run in the interpreter: the variable
is read when a kernel is decorated, so it is set before any dsv4ops Triton module is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
