"""Adapters to other libraries; each imports its library, so import them by name (`import dsv4ops`
imports none)."""
