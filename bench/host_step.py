"""Host time of a decode step outside the GPU (no GPU needed):
1. `Engine.step` (scheduler, block manager, bookkeeping) with a stand-in runner that returns tokens at
   once, at 1, 8 and 64 running requests of the tiny preset;
2. block placement + page-table refresh per decode token of one flash-slice request at a long context,
   the device tables replaced by host memory."""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv4rt.config import from_dict
from dsv4rt.engine import Engine
from dsv4rt.kv import BlockManager, SlabAllocator, build_plan
from dsv4rt.model.tables import PageTables
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import PRESETS, make_tiny
from results import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_blocks import HostArena  # noqa: E402


class InstantRunner:
    def run(self, step):
        return {r.id: 5 for r, n in step if r.computed + n == r.num_tokens}

    def release(self, request_id):
        pass

    def snapshot(self, request_id):
        return None

    def restore(self, request_id, snapshot):
        pass

    def discard(self, snapshot):
        pass


def engine_step_us(model: Path, batch: int, steps: int) -> float:
    e = Engine(model, kv_bytes=1 << 30, max_running=64)
    e.runner = InstantRunner()
    for _ in range(batch):
        e.add_request([3] * 100, SamplingParams(temperature=0, max_new_tokens=steps + 10))
    e.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    return (time.perf_counter() - t0) / steps * 1e6


def table_refresh_us(context: int, tokens: int) -> float:
    plan = build_plan(from_dict(PRESETS["flash-slice"]), "exact")
    m = BlockManager(plan, SlabAllocator(int(plan.sequence_bytes(context + tokens + 8) * 1.1) + (64 << 20),
                                         plan.class_page_bytes))
    tables = PageTables(HostArena(), plan, m.allocator, context + tokens + 8, 1)
    length = 0
    while length < context:
        length = min(context, length + 4096)
        m.place(0, length)
    tables.refresh(0, m, 0, None)
    t0 = time.perf_counter()
    for _ in range(tokens):
        length += 1
        m.place(0, length)
        tables.refresh(0, m, 0, None)
    return (time.perf_counter() - t0) / tokens * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--context", type=int, default=1 << 20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(Path(tmp) / "tiny", "tiny")
        engine = {b: engine_step_us(model, b, a.steps) for b in (1, 8, 64)}
    refresh = table_refresh_us(a.context, 512)
    print("| what | µs |\n|---|---|")
    for b, us in engine.items():
        print(f"| Engine.step, {b} running (stand-in runner) | {us:.1f} |")
    print(f"| place + table refresh per decode token, flash-slice at {a.context} | {refresh:.1f} |")
    save("host_step", dict(engine_step_us=engine, table_refresh_us=refresh, context=a.context))


if __name__ == "__main__":
    main()
