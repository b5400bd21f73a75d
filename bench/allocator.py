"""Operations per second of the KV slab allocator, and of the block manager's decode step.

usage: python bench/allocator.py [--region-gib 64] [--ops 1000000] [--numerics faithful]
Flash's page classes over a region of the given size. Prints a table and writes
bench/results/allocator.json.
"""
import argparse
import json
import platform
import random
import time
from pathlib import Path

from dsv4rt.config import ModelConfig
from dsv4rt.kv import BlockManager, SlabAllocator, build_plan

FLASH = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs" / "deepseek-v4-flash.json"


def pairs_at_half_occupancy(plan, region: int, ops: int, rng) -> float:
    """alloc+free pairs per second, classes at random, with half of every class's share in use."""
    a = SlabAllocator(region, plan.class_page_bytes)
    live = []
    for cls in (0, 1, 2):
        live += [a.alloc(cls) for _ in range(a.n_slabs * a.pages_per_slab[cls] // 6)]
    classes = [rng.randrange(3) for _ in range(ops)]
    victims = [rng.randrange(len(live)) for _ in range(ops)]
    alloc, free = a.alloc, a.free
    t0 = time.perf_counter()
    for cls, v in zip(classes, victims):
        page = alloc(cls)
        free(live[v])
        live[v] = page
    return ops / (time.perf_counter() - t0)


def burst(plan, region: int, cls: int) -> tuple[float, float]:
    """Allocations per second until the region is full of one class, then frees per second (slabs churn)."""
    a = SlabAllocator(region, plan.class_page_bytes)
    alloc, free = a.alloc, a.free
    t0 = time.perf_counter()
    pages = [alloc(cls) for _ in range(a.n_slabs * a.pages_per_slab[cls])]
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
    ap.add_argument("--region-gib", type=float, default=64)
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--numerics", default="faithful")
    a = ap.parse_args()
    plan = build_plan(ModelConfig.load(FLASH), a.numerics)
    region = int(a.region_gib * (1 << 30))
    rng = random.Random(0)
    rows = [("alloc+free pair, random class, half full", pairs_at_half_occupancy(plan, region, a.ops, rng))]
    for cls, name in enumerate(("large", "medium", "small")):
        allocs, frees = burst(plan, region, cls)
        rows += [(f"alloc until full, {name} ({plan.class_page_bytes[cls]:,} B)", allocs),
                 (f"free all, {name}", frees)]
    rows.append(("BlockManager.place, Flash decode token", decode_steps(plan, region, 64, 256)))
    print(f"{'operation':48s} {'per second':>14s} {'ns each':>9s}")
    for name, rate in rows:
        print(f"{name:48s} {rate:14,.0f} {1e9 / rate:9.0f}")
    result = dict(model="deepseek-v4-flash", numerics=a.numerics, region_bytes=region,
                  size_classes=list(plan.class_page_bytes), machine=platform.processor() or platform.machine(),
                  python=platform.python_version(), ops_per_second={name: round(rate) for name, rate in rows})
    out = Path(__file__).parent / "results" / "allocator.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
