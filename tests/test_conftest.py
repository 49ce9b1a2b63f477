"""tests/conftest.py: under CI=true a skipped test (in its body, its setup or its module's
collection) fails the run; elsewhere it skips, with its reason listed (-rs)."""

import os
import pathlib
import shutil
import subprocess
import sys

SKIPPING = {
    "test_skips.py": "import pytest\n\n\ndef test_body():\n    pytest.skip('no reason to run')\n\n\n"
                     "@pytest.mark.skipif(True, reason='a condition')\ndef test_marked():\n    pass\n",
    "test_module.py": "import pytest\n\npytest.importorskip('no_such_package_dsv4ops')\n\n\ndef test_x():\n    pass\n",
}


def _run(tmp_path, ci: bool, files=tuple(SKIPPING)):
    shutil.copy(pathlib.Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name in files:
        (tmp_path / name).write_text(SKIPPING[name])
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_fails_under_ci(tmp_path):
    out = _run(tmp_path, ci=True, files=["test_skips.py"])
    assert out.returncode != 0, out.stdout
    assert out.stdout.count("skipped under CI=true") == 2, out.stdout  # the body's skip and the marker's
    assert " skipped" not in out.stdout.splitlines()[-1], out.stdout


def test_a_skipped_module_fails_under_ci(tmp_path):
    out = _run(tmp_path, ci=True, files=["test_module.py"])
    assert out.returncode != 0, out.stdout
    assert "skipped under CI=true" in out.stdout and "no_such_package_dsv4ops" in out.stdout, out.stdout


def test_a_skip_skips_elsewhere(tmp_path):
    out = _run(tmp_path, ci=False)
    assert out.returncode == 0, out.stdout
    assert "3 skipped" in out.stdout.splitlines()[-1] and "no_such_package_dsv4ops" in out.stdout, out.stdout
