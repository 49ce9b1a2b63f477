"""Builds (JIT, on first use) and loads the CUDA C++ kernels of csrc/: the router kernels bind
themselves to the `dsv4::gate_topk` / `dsv4::hash_route` CUDA dispatch key; the sm_90 sparse
attention kernel is `dsv4_csrc::sparse_attn`, called by dsv4ops/sparse_attn/cuda.py, and the
indexer's scoring and top-k selects `dsv4_csrc::topk_score` / `dsv4_csrc::topk_select` /
`dsv4_csrc::topk_grid`, called by dsv4ops/indexer/cuda.py. Nothing else is registered here; a
failure raises (no silent fallback)."""

import functools
import os
import pathlib
import sys

import torch

# A wheel carries csrc/ as dsv4ops/_csrc (pyproject.toml maps it there); a source checkout, editable
# install included, has no dsv4ops/_csrc and keeps csrc/ beside the package.
_HERE = pathlib.Path(__file__).resolve().parent
_CSRC = _HERE / "_csrc" if (_HERE / "_csrc").is_dir() else _HERE.parent / "csrc"
_SOURCES = ("dsv4ops.cpp", "indexer/score_api.cpp", "indexer/score.cu", "indexer/topk_select_api.cpp",
            "indexer/topk_select.cu", "indexer/topk_grid.cu", "router/api.cpp",
            "router/gate_topk.cu", "router/hash_route.cu", "sparse_attn/sparse_attn_api.cpp",
            "sparse_attn/sparse_attn.cu", "sparse_attn/small_heads.cu", "sparse_attn/combine.cu")
# Explicit -gencode pairs: without them cpp_extension derives the archs from the visible GPUs, and the
# `-arch=sm_90a` shorthand was reported to add a plain sm_90 pass. sm_100a needs nvcc >= 12.8.
# -lineinfo (line tables beside the same machine code) lets compute-sanitizer and ncu name csrc/'s
# files and lines; tests/racecheck_report.py sorts racecheck's reports by them.
_GENCODE = ("-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a")


def source_files() -> list[pathlib.Path]:
    """The files the JIT build compiles (their headers sit beside them, included by relative path)."""
    return [_CSRC / s for s in _SOURCES]


def _unavailable_reason() -> str | None:
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "nvcc was not found (set CUDA_HOME)"
    missing = [str(f) for f in source_files() if not f.is_file()]
    if missing:
        return f"csrc/ sources are missing ({', '.join(missing)}): reinstall dsv4ops (a wheel or a source checkout)"
    return None


def build_directory() -> pathlib.Path:
    """Per torch/CUDA/Python build folder under DSV4OPS_CACHE (default ~/.cache/dsv4ops)."""
    root = pathlib.Path(os.environ.get("DSV4OPS_CACHE", pathlib.Path.home() / ".cache" / "dsv4ops"))
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_cu{torch.version.cuda}"
    return root / "torch_extensions" / tag.replace("+", "_")


@functools.cache
def load() -> bool:
    """Builds (first call on a machine: about a minute) and loads the extension; returns True once
    the CUDA kernels are bound. Raises a RuntimeError with the reason when they cannot be: callers
    ask for these kernels only where the arch table requires them, and nothing falls back silently
    to the reference kernels."""
    reason = _unavailable_reason()
    if reason is None:
        from torch.utils import cpp_extension

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(
                name="dsv4ops_csrc",
                sources=[str(f) for f in source_files()],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo", *_GENCODE],
                build_directory=str(folder),
                is_python_module=False,
            )
        except (RuntimeError, OSError, ImportError) as error:  # a failed nvcc / ninja run, or dlopen
            reason = f"building csrc/ failed: {error}"
    if reason is not None:
        raise RuntimeError(f"dsv4ops: the CUDA C++ kernels (csrc/) are required on this GPU by the arch "
                           f"table (dsv4ops/_arch.py) and cannot be loaded: {reason}")
    return True
