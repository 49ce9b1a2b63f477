"""README.md's Python blocks run as written, each in a fresh interpreter: a block fenced ```python
in the CPU suite, a block fenced ```python gpu in the GPU tier (-m gpu, on a CUDA machine); a block
fenced ```python torchrun runs under torchrun on 2 processes (tests/test_readme_dist.py). An
example that drifts from the API fails here. Every fence of the README must be one of the known
kinds, so a block cannot drop out of the suite by a typo in its info string."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(.*)$")
KINDS = {"python": "cpu", "python gpu": "gpu", "python torchrun": "torchrun", "bash": None, "": None}


def _blocks() -> list[tuple[str, str, str]]:
    """(kind, id, code) of every fenced block of README.md; the id names its section and line."""
    blocks, heading, open_at, kind, lines = [], "top", None, None, []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if open_at is None and line.startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")[:40]
        elif m and open_at is None:
            open_at, kind, lines = n, m.group(1).strip(), []
        elif m and open_at is not None:
            assert m.group(1) == "", f"README.md:{n}: a fence opens inside the block of line {open_at}"
            blocks.append((kind, f"{heading}-L{open_at}", "\n".join(lines) + "\n"))
            open_at = None
        elif open_at is not None:
            lines.append(line)
    assert open_at is None, f"README.md:{open_at}: the block is never closed"
    return blocks


BLOCKS = _blocks()


def _params(tier: str):
    return [pytest.param(code, id=name) for kind, name, code in BLOCKS if KINDS.get(kind) == tier]


def test_every_fence_is_a_known_kind():
    unknown = [(kind, name) for kind, name, _ in BLOCKS if kind not in KINDS]
    assert not unknown, f"README fences of no known kind ({sorted(KINDS)}): {unknown}"
    assert len(_params("cpu")) >= 4 and len(_params("gpu")) >= 1  # first example, serving, patch_model, V4.1


def _run(code: str, tmp_path):
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"the block failed:\n{out.stderr[-4000:]}"
    assert out.stdout.strip(), "the block printed nothing (each block shows its result)"


@pytest.mark.parametrize("code", _params("cpu"))
def test_block(code, tmp_path):
    _run(code, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("code", _params("gpu"))
def test_gpu_block(code, tmp_path):
    _run(code, tmp_path)
