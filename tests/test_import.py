"""`import dsv4ops` is cheap: no triton, no cutlass, no transformers, no CUDA, no compiled extension;
and the package's modules import each other without a cycle (lazy imports inside functions included),
so the op definitions (dsv4ops/ops.py) never reach back into the public API that calls them."""

import ast
import pathlib
import subprocess
import sys

BLOCKER = """
import builtins, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    blocked = ("triton", "cutlass", "cuda", "tvm_ffi", "transformers", "safetensors")
    if name.split(".")[0] in blocked or name.startswith("dsv4ops._C"):
        raise ImportError(f"blocked import of {name}")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
import torch
import dsv4ops
import dsv4ops.testing, dsv4ops.testing_v41
from dsv4ops import DSV4AttentionConfig, DeepseekV4Attention
layer = DeepseekV4Attention(DSV4AttentionConfig.tiny(), 1)
x = torch.randn(1, 9, 256)
assert layer(x).shape == (1, 9, 256)
assert not torch.cuda.is_initialized()
print("ok", [m for m in sys.modules if m.split(".")[0] in ("triton", "cutlass", "transformers", "safetensors")
             or m == "torch.utils.cpp_extension"])  # the csrc/ build loads it on first use only
"""


def test_import_needs_no_gpu_triton_or_cutlass():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dsv4ops"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the dsv4ops modules it imports anywhere in its source (top level or in a function)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {m for m in targets if m in modules and m != name}
    return graph


def test_no_import_cycle():
    graph = import_graph()
    assert graph["dsv4ops.ops"] and "dsv4ops.router.api" in graph["dsv4ops.router.modules"]  # the graph sees imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]):
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import cycle: {' -> '.join(path[path.index(n):] + [n])}"
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_import_binds_cuda_kernels_without_triton():
    code = ("import sys, dsv4ops, torch; assert 'triton' not in sys.modules; "
            "assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f'dsv4::{op}', 'CUDA') "
            "for op in dsv4ops.backends.TRITON_LAUNCHERS); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
