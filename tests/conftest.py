"""Shared fixtures. On a machine without CUDA, Triton kernels run in the interpreter: the variable
is read when a kernel is decorated, so it is set before any dsv4ops Triton module is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk cache key omits ATEN_CPU_CAPABILITY: a CPU kernel cached by a run with AVX-512
# code fails to compile in a run with ATEN_CPU_CAPABILITY=default ("'at::vec' has not been declared").
# Runs with a capability override get a cache of their own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# CI runs the whole CPU suite with every extra it needs (.ci/run): a test that skips there (a missing
# package, a condition that no longer holds) is reported as a failure, never passed over.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_skip_in_ci(report):
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (CI must run every test): {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())
