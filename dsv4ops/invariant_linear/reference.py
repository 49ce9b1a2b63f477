"""Reference kernel of `dsv4::invariant_linear`: out = x @ weight^T, products summed in fp32, one
rounding to out's dtype.

Row by row. torch.mm on the CPU is not row-invariant: MKL's fp32 GEMM gives a row other bits at
M = 1, 2, 3 or 7 than at M = 130 (x86-64 AVX2, torch 2.13, K = 64 .. 4096), the kernel it picks
depending on M. Here every row is one [1, K] x [K, N] product of a fresh (64-byte aligned) fp32
copy of that row with the same fp32 weight: the same call, shape and alignment whatever other rows
x holds, so a row's bits are those of the row alone. 16-bit operands are upcast first: their
products are exact in fp32, as on the tensor cores."""

import torch
from torch import Tensor

from dsv4ops.reference.functional import acc_dtype


def invariant_linear(x: Tensor, weight: Tensor, out: Tensor) -> None:
    acc = acc_dtype(x.dtype)
    w = weight.to(acc).t()
    for i in range(x.shape[0]):
        out[i] = torch.mm(x[i:i + 1].to(acc, copy=True), w)[0].to(out.dtype)
