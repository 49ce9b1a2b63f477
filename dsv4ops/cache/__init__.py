"""The serving cache: capacity config, per-layer pools, host-side manager and step metadata."""

from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.manager import CacheFullError, KVCacheManager
from dsv4ops.cache.step import StepMeta

__all__ = ["CacheConfig", "CacheFullError", "KVCacheManager", "StepMeta"]
