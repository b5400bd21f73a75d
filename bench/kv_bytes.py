"""KV cache bytes per token as the allocator hands them out, against `dsv4rt plan` and docs/caches.md#bytes-per-token.

One sequence is grown to the context (a prefill in 4096-token chunks, then decode steps) in a block
manager over a host-only slab allocator; the bytes it holds are counted from the allocator's pages.
No GPU: the allocator keeps its metadata on the host."""
import argparse
from pathlib import Path

from dsv4rt.config import ModelConfig
from dsv4rt.kv.blocks import BlockManager
from dsv4rt.kv.plan import build_plan
from dsv4rt.kv.slab import SlabAllocator
from results import save

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs"
MODEL_MD_GIB = {("flash", "exact"): 6.72, ("flash", "faithful"): 3.44, ("pro", "exact"): 9.62, ("pro", "faithful"): 4.92}


def held_bytes(m: BlockManager) -> int:
    a = m.allocator
    return sum(a.stats(c).used_pages * a.page_bytes[c] for c in range(3))


def measure(name: str, numerics: str, context: int) -> dict:
    cfg = ModelConfig.load(CONFIGS / f"deepseek-v4-{name}.json")
    plan = build_plan(cfg, numerics)
    m = BlockManager(plan, SlabAllocator(int(plan.sequence_bytes(context + 8) * 1.05) + (64 << 20),
                                         plan.class_page_bytes))
    length = 0
    while length < context - 16:
        length = min(context - 16, length + 4096)
        m.place("r", length)
    while length < context:
        length += 1
        m.place("r", length)
    held = held_bytes(m)
    return dict(model=name, numerics=numerics, context=context, held_gib=held / 2**30,
                held_bytes_per_token=held / context, plan_bytes_per_token=plan.bytes_per_token,
                plan_gib=plan.sequence_bytes(context) / 2**30, model_md_gib=MODEL_MD_GIB[name, numerics])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=1 << 20)
    a = ap.parse_args()
    rows = [measure(n, x, a.context) for n in ("flash", "pro") for x in ("exact", "faithful")]
    print("| model | numerics | held GiB | held B/token | plan B/token | plan GiB | docs GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['numerics']} | {r['held_gib']:.4f} | {r['held_bytes_per_token']:.2f} | "
              f"{r['plan_bytes_per_token']:.2f} | {r['plan_gib']:.4f} | {r['model_md_gib']:.2f} |")
    save("kv_bytes", dict(rows=rows))


if __name__ == "__main__":
    main()
