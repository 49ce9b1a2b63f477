"""CUDA kernels of the attention ops, registered lazily.

`import dsv4ops` registers, for each attention op, one thin CUDA kernel (`register_kernel("cuda")`)
and imports nothing else: no triton, no CUDA call. The first call of an op with CUDA tensors
resolves its backend once per (op, GPU architecture) from `dsv4ops._arch.backends(op)`:
"triton" imports dsv4ops/<family>/triton.py (that is when triton loads and the kernel JIT-compiles;
`dsv4ops.warmup` does it for every kernel of a configuration ahead of CUDA-graph capture), "csrc"
the op's launcher in CSRC_LAUNCHERS (it builds csrc/ on first use, dsv4ops.csrc), and
"reference" (an architecture without a row in the table) runs the op's reference kernel, which is
the table's choice, not a fallback. An op the chosen backend cannot serve (other layout dims, an
unsupported dtype) raises; it never falls back silently.

CPU tensors never reach these kernels: they dispatch to the ops' reference kernels.
To run the reference on CUDA tensors: `dsv4ops.ops.<op>.set_kernel_enabled("cuda", False)` (a
context manager), or call dsv4ops/<family>/reference.py directly.
"""

import functools
import importlib
import os

from dsv4ops import _arch, ops

# op -> (module with its Triton launcher, launcher name); each launcher takes the op's arguments.
TRITON_LAUNCHERS: dict[str, tuple[str, str]] = {
    "qkv_prep": ("dsv4ops.qkv_prep.triton", "qkv_prep"),
    "compressor_update": ("dsv4ops.compressor.triton", "compressor_update"),
    "indexer_q_prep": ("dsv4ops.indexer.triton_prep", "indexer_q_prep"),
    "indexer_k_prep": ("dsv4ops.indexer.triton_prep", "indexer_k_prep"),
    "indexer_topk": ("dsv4ops.indexer.triton", "indexer_topk"),
    "sparse_attn": ("dsv4ops.sparse_attn.triton", "sparse_attn"),
    "attn_merge": ("dsv4ops.attn_merge.triton", "attn_merge"),
    "visible_entries": ("dsv4ops.visible_entries.triton", "visible_entries"),
    "inv_rope": ("dsv4ops.inv_rope.triton", "inv_rope"),
    "fp8_linear": ("dsv4ops.fp8_linear.triton", "fp8_linear"),
    "invariant_linear": ("dsv4ops.invariant_linear.triton", "invariant_linear"),
    "fp8_linear_w8a8": ("dsv4ops.fp8_linear.w8a8", "fp8_linear_w8a8"),
    "pack_kv": ("dsv4ops.quant.triton", "pack_kv"),
    "unpack_kv": ("dsv4ops.quant.triton", "unpack_kv"),
}


# op -> (module, launcher) of the ops whose arch-table row starts with "csrc": the launcher picks the
# CUDA C++ kernel where it serves the arguments and the op's Triton kernel elsewhere.
CSRC_LAUNCHERS: dict[str, tuple[str, str]] = {
    "indexer_topk": ("dsv4ops.indexer.cuda", "indexer_topk"),
    "sparse_attn": ("dsv4ops.sparse_attn.cuda", "sparse_attn"),
}


def _launcher(table: dict[str, tuple[str, str]], op: str):
    module, name = table[op]
    return getattr(importlib.import_module(module), name)


def triton_launcher(op: str):
    """The Triton launcher of `op` (imports triton)."""
    return _launcher(TRITON_LAUNCHERS, op)


@functools.cache
def resolve(op: str, capability: tuple[int, int] | None):
    """The callable serving `op` on CUDA tensors of a GPU with `capability`, per the arch table."""
    chosen = _arch.backends(op, capability)
    backend = chosen[0]
    if backend == "triton":
        return triton_launcher(op)
    if backend == "csrc" and op in CSRC_LAUNCHERS:
        return _launcher(CSRC_LAUNCHERS, op)
    if backend == "reference":
        return getattr(ops, op)._init_fn  # the op's own body: metadata checks + reference kernel
    raise NotImplementedError(f"op: dsv4::{op} has no {backend!r} backend; the arch table names {chosen}")


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    import torch

    if os.environ.get("DSV4OPS_ARCH"):  # the override of dsv4ops._arch (tests, cross-compilation)
        return _arch.capability()
    return torch.cuda.get_device_capability(device_index)


def _thin_kernel(op: str):
    def cuda_kernel(*args, **kwargs):
        device = args[0].device  # every attention op's first argument is a tensor
        return resolve(op, _capability(device.index or 0))(*args, **kwargs)

    cuda_kernel.__name__ = f"{op}_cuda"
    cuda_kernel.__qualname__ = cuda_kernel.__name__
    return cuda_kernel


def register_cuda_kernels() -> None:
    """Bind the thin CUDA kernel of every attention op (idempotent; called by `import dsv4ops`)."""
    for op in TRITON_LAUNCHERS:
        if op not in _registered:
            getattr(ops, op).register_kernel("cuda")(_thin_kernel(op))
            _registered.add(op)


_registered: set[str] = set()
register_cuda_kernels()
