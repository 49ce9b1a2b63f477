"""Fake (meta) kernels of every `dsv4::` op, installed as `dsv4ops._meta`; one module per family."""

from dsv4ops._meta import router  # noqa: F401
