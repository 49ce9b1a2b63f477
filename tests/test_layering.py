"""The import floors of dsv4ops, read from the source (ast; nothing is imported): the op families
and their kernels (and their fakes in meta/) never import the serving cache, the layers, the
parallel helpers or the integrations; the cache never imports the layers. A lower module that
imported a higher one would drag the whole serving stack into every op import (issue 52)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dsv4ops"
OP_FAMILIES = ("qkv_prep", "compressor", "indexer", "sparse_attn", "inv_rope", "router", "quant", "visible_entries",
               "attn_merge", "fp8_linear")
ABOVE_THE_OPS = ("dsv4ops.cache", "dsv4ops.layers", "dsv4ops.parallel", "dsv4ops.integrations")


def _module_name(path: Path) -> str:
    """meta/ is installed as dsv4ops._meta (pyproject's package-dir)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "meta":
        parts = ["dsv4ops", "_meta", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, top level or inside a function; `from P import
    n` counts as P.n too (n may be a submodule), relative imports resolved against `package`."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _below(module: str, floors: tuple[str, ...]) -> bool:
    """module is one of `floors` or inside one ("dsv4ops.layers" covers dsv4ops.layers_v41 too)."""
    return any(module == f or module.startswith(f + ".") or module.startswith(f + "_") for f in floors)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def violations(source: str, package: str, forbidden: tuple[str, ...]) -> dict[int, str]:
    """{line: the first module it imports from `forbidden`}."""
    out = {}
    for line, module in imported_modules(source, package):
        if _below(module, forbidden):
            out.setdefault(line, module)
    return out


def upward_imports(files, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in files
            for line, module in violations(path.read_text(), _package(path), forbidden).items()]


def op_files() -> list[Path]:
    files = [PKG / "ops.py", *sorted((ROOT / "meta").rglob("*.py"))]
    for family in OP_FAMILIES:
        files += sorted((PKG / family).rglob("*.py"))
    return files


def test_the_ops_and_kernels_import_nothing_above_them():
    files = op_files()
    assert len(files) > 2 * len(OP_FAMILIES)  # the walk found the families
    assert upward_imports(files, ABOVE_THE_OPS) == []


def test_the_cache_never_imports_the_layers():
    files = sorted((PKG / "cache").rglob("*.py"))
    assert len(files) > 3
    assert upward_imports(files, ("dsv4ops.layers",)) == []


@pytest.mark.parametrize("line", ["from dsv4ops.cache.step import StepMeta", "import dsv4ops.parallel.dcp",
                                  "from ..layers_v41 import DeepseekV41Attention", "from dsv4ops import integrations"])
def test_the_check_sees_every_spelling_of_an_upward_import(line):
    """The scan itself, on an op file's source with one upward import added inside a function
    (absolute, dotted, relative, from the package), so a scan that found nothing could not pass
    the tests above."""
    path = PKG / "indexer" / "api.py"
    source = path.read_text()
    assert violations(source, _package(path), ABOVE_THE_OPS) == {}
    probe = source + f"\n\ndef _late():\n    {line}\n"
    assert list(violations(probe, _package(path), ABOVE_THE_OPS)) == [len(source.splitlines()) + 4]
