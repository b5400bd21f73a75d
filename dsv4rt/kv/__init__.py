"""KV cache: cache kinds and size classes (plan), slab allocator, per-request block tables."""
from .blocks import BlockManager, OutOfPages
from .plan import CLASS_NAMES, LARGE, MEDIUM, NUMERICS, SMALL, CacheKind, KVPlan, build_plan
from .slab import DEFAULT_SLAB_BYTES, ClassStats, DoubleFree, SlabAllocator

__all__ = ["BlockManager", "OutOfPages", "CLASS_NAMES", "LARGE", "MEDIUM", "NUMERICS", "SMALL", "CacheKind", "KVPlan",
           "build_plan", "DEFAULT_SLAB_BYTES", "ClassStats", "DoubleFree", "SlabAllocator"]
