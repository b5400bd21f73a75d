"""Operations per second of the KV slab allocator, and of the block manager's decode step.

usage: python bench/allocator.py [--region-gib 16] [--ops 1000000] [--numerics faithful]
Flash's page classes over a region of the given size. Prints a table and writes
bench/results/allocator.json.
"""
import argparse
import platform
import random
import time
from pathlib import Path

from results import save
from dsv4rt.config import ModelConfig
from dsv4rt.kv import BlockManager, SlabAllocator, build_plan

FLASH = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs" / "deepseek-v4-flash.json"


def pairs_at_half_occupancy(plan, region: int, ops: int, rng) -> float:
    """free+alloc pairs per second: a random live page is freed and one of its class allocated, with
    every class on a sixth of the slabs, so pages wander between slabs and slabs between classes."""
    a = SlabAllocator(region, plan.class_page_bytes)
    live, classes = [], []
    for cls in (0, 1, 2):
        n = a.n_slabs * a.pages_per_slab[cls] // 6
        live += [a.alloc(cls) for _ in range(n)]
        classes += [cls] * n
    victims = [rng.randrange(len(live)) for _ in range(ops)]
    alloc, free = a.alloc, a.free
    t0 = time.perf_counter()
    for v in victims:
        free(live[v])
        live[v] = alloc(classes[v])
    rate = ops / (time.perf_counter() - t0)
    assert min(live) >= 0
    return rate


def burst(plan, region: int, cls: int, count: int) -> tuple[float, float]:
    """Allocations per second of `count` pages of one class (or until the region is full), then frees per second."""
    a = SlabAllocator(region, plan.class_page_bytes)
    alloc, free = a.alloc, a.free
    t0 = time.perf_counter()
    pages = [alloc(cls) for _ in range(min(count, a.n_slabs * a.pages_per_slab[cls]))]
    t1 = time.perf_counter()
    for p in pages:
        free(p)
    t2 = time.perf_counter()
    assert min(pages) >= 0 and a.free_slabs == a.n_slabs
    return len(pages) / (t1 - t0), len(pages) / (t2 - t1)


def decode_steps(plan, region: int, requests: int, tokens: int) -> float:
    """BlockManager.place calls per second for requests decoding one token at a time after a 4096-token prompt."""
    m = BlockManager(plan, SlabAllocator(region, plan.class_page_bytes))
    for r in range(requests):
        m.place(r, 4096)
    t0 = time.perf_counter()
    for n in range(4097, 4097 + tokens):
        for r in range(requests):
            m.place(r, n)
    return requests * tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--region-gib", type=float, default=16)
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--numerics", default="faithful")
    a = ap.parse_args()
    plan = build_plan(ModelConfig.load(FLASH), a.numerics)
    region = int(a.region_gib * (1 << 30))
    rng = random.Random(0)
    # random pages over a large region mostly measure cache misses; 1 GiB shows the allocator's own cost
    rows = [(f"free+alloc pair, random page, half of {gib:g} GiB",
             pairs_at_half_occupancy(plan, int(gib * (1 << 30)), a.ops, rng)) for gib in (1, a.region_gib)]
    for cls, name in enumerate(("large", "medium", "small")):
        allocs, frees = burst(plan, region, cls, a.ops)
        rows += [(f"alloc in a row, {name} ({plan.class_page_bytes[cls]:,} B)", allocs),
                 (f"free in a row, {name}", frees)]
    rows.append(("BlockManager.place, Flash decode token", decode_steps(plan, region, 64, 256)))
    print(f"{'operation':48s} {'per second':>14s} {'ns each':>9s}")
    for name, rate in rows:
        print(f"{name:48s} {rate:14,.0f} {1e9 / rate:9.0f}")
    result = dict(model="deepseek-v4-flash", numerics=a.numerics, region_bytes=region,
                  size_classes=list(plan.class_page_bytes), machine=platform.processor() or platform.machine(),
                  python=platform.python_version(), ops_per_second={name: round(rate) for name, rate in rows})
    save("allocator", result)


if __name__ == "__main__":
    main()
