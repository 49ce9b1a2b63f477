"""The serving cache: capacity config, per-layer pools, host-side manager and step metadata (V4), and
the V4.1 stack's pools, manager and step metadata."""

from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.manager import CacheFullError, KVCacheManager
from dsv4ops.cache.step import StepMeta
from dsv4ops.cache.v41 import V41CacheManager, V41StepMeta

__all__ = ["CacheConfig", "CacheFullError", "KVCacheManager", "StepMeta", "V41CacheManager", "V41StepMeta"]
