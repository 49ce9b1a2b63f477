"""A wheel carries csrc/: the CUDA C++ sources that dsv4ops/csrc.py builds on first use ship as
package data (dsv4ops/_csrc), and an installed wheel finds them without the checkout. Nothing is
compiled here (no nvcc on CI): the check is that every file the JIT build reads is found."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import torch

from dsv4ops import csrc

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_SUFFIXES = {".cu", ".cuh", ".h", ".cpp"}

# Run in a subprocess with no site (-S: no .pth, so no editable-install finder) and only the
# installed target plus torch's site-packages on the path; prints the source files csrc.py would
# compile, and every file they #include "..." (resolved beside the including file, as nvcc does).
_LOCATE = r"""
import pathlib, re, sys
import dsv4ops
from dsv4ops import csrc
target = pathlib.Path(sys.argv[1]).resolve()
assert pathlib.Path(dsv4ops.__file__).resolve().is_relative_to(target), dsv4ops.__file__
seen, todo = set(), list(csrc.source_files())
while todo:
    path = todo.pop().resolve()
    if path in seen:
        continue
    assert path.is_file(), f"missing: {path}"
    assert path.is_relative_to(target), f"found outside the installed wheel: {path}"
    seen.add(path)
    todo += [path.parent / name for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)]
print("\n".join(sorted(str(p.relative_to(target)) for p in seen)))
"""


def _pip(*args, cwd):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], cwd=cwd, env=env, check=True)


def test_the_checkout_finds_its_sources():
    """Source checkout / editable install: csrc/ stays at the top level and is found there."""
    assert [f for f in csrc.source_files() if not f.is_file()] == []
    assert all(f.is_relative_to(ROOT / "csrc") for f in csrc.source_files())


def test_an_installed_wheel_finds_every_source(tmp_path):
    # Build from a copy so that build/ and *.egg-info never land in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in ("dsv4ops", "meta", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    _pip("wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
         cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("dsv4ops-*.whl")

    shipped = {name.removeprefix("dsv4ops/_csrc/") for name in zipfile.ZipFile(wheel).namelist()
               if name.startswith("dsv4ops/_csrc/")}
    in_checkout = {str(p.relative_to(ROOT / "csrc")) for p in (ROOT / "csrc").rglob("*")
                   if p.suffix in CUDA_SUFFIXES}
    assert sorted(in_checkout - shipped) == [], "csrc/ files the wheel leaves out"

    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    torch_site = pathlib.Path(torch.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(target), str(torch_site)))}
    run = subprocess.run([sys.executable, "-S", "-c", _LOCATE, str(target)], cwd=outside, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    found = set(run.stdout.split())
    # Every source compiled and every header they include, found in the installed copy.
    compiled = {f"dsv4ops/_csrc/{s}" for s in csrc._SOURCES}
    assert compiled <= found
    assert len(found) > len(compiled), "the sources' #include \"...\" headers were not followed"
    assert all(re.fullmatch(r"dsv4ops/_csrc/.+", f) for f in found)
