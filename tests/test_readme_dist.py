"""README blocks fenced ```python torchrun (the tensor- and context-parallel examples) run as
written on 2 gloo processes under torchrun (test_readme.py runs the single-process kinds). Issue 31."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python torchrun\n(.*?)^```$", flags=re.S | re.M)


def _blocks() -> list[str]:
    return FENCE.findall(README.read_text())


def test_the_readme_has_torchrun_blocks():
    assert len(_blocks()) >= 1


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_torchrun_block_runs(index, tmp_path):
    script = tmp_path / f"block{index}.py"
    script.write_text(_blocks()[index])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier: gloo
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: " in run.stdout, run.stdout
