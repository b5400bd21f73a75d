"""Host time of a decode step outside the GPU (no GPU needed):
1. `Engine.step` (scheduler, block manager, bookkeeping) at 1, 8, 64 and 128 running requests of the
   tiny preset, with a stand-in runner that returns tokens at once, and with the GPU runner over
   HostModel (tests/test_engine.py: page tables and step inputs in host memory, no kernels);
2. block placement + page-table refresh per decode token of one flash-slice request at a long context,
   the device tables replaced by host memory;
3. page-table copies to the device per decode token and request with the deepseek-v4-flash cache plan."""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv4rt.config import from_dict
from dsv4rt.engine import Engine
from dsv4rt.engine.gpu_runner import GpuRunner
from dsv4rt.kv import BlockManager, SlabAllocator, build_plan
from dsv4rt.model.tables import PageTables
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import PRESETS, make_tiny
from results import save

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from test_blocks import HostArena  # noqa: E402
from test_engine import HostModel  # noqa: E402


class InstantRunner:
    def run(self, step):
        return [5] * len(step)

    def release(self, request_id):
        pass

    def snapshot(self, request_id):
        return None

    def restore(self, request_id, snapshot):
        pass

    def discard(self, snapshot):
        pass


class StandInModel(HostModel):
    """Token 5 for every row: the batch stays whole."""

    def outputs(self, n, every_row=False, sampled=False):
        return np.full(n, 5, np.int32)


def engine_step_us(model: Path, batch: int, steps: int, gpu_runner: bool, reps: int = 3) -> float:
    """The best of `reps` runs (this box is shared) of the mean step time."""
    best = float("inf")
    for _ in range(reps):
        e = Engine(model, kv_bytes=1 << 30, max_running=max(batch, 64), prefix_cache_blocks=0 if gpu_runner else 256)
        s = e.scheduler
        e.runner = GpuRunner(StandInModel(s.blocks, s.max_running, max(s.token_budget, s.max_running), 4096),
                             graphs=False) if gpu_runner else InstantRunner()
        for _ in range(batch):
            e.add_request([3] * 100, SamplingParams(temperature=0, max_new_tokens=steps + 10))
        e.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


class CountingArena(HostArena):
    class Buffer(HostArena.Buffer):
        copies = 0

        def copy_from_host(self, host, stream=None, offset=0):
            CountingArena.Buffer.copies += 1
            super().copy_from_host(host, stream, offset)


def decode_tokens(plan, context: int, tokens: int) -> tuple[float, float]:
    """(µs of place + table refresh, device copies) per decode token of one request from `context`,
    after `tokens` untimed ones (they fill the block manager's decode moves)."""
    total = context + 2 * tokens + 8
    m = BlockManager(plan, SlabAllocator(int(plan.sequence_bytes(total) * 1.1) + (64 << 20), plan.class_page_bytes))
    tables = PageTables(CountingArena(), plan, m.allocator, total, 1)
    length = 0
    while length < context:
        length = min(context, length + 4096)
        m.place(0, length)
    for _ in range(tokens):
        length += 1
        m.place(0, length)
        tables.refresh(0, m, 0, None)
    copies, t0 = CountingArena.Buffer.copies, time.perf_counter()
    for _ in range(tokens):
        length += 1
        m.place(0, length)
        tables.refresh(0, m, 0, None)
    return (time.perf_counter() - t0) / tokens * 1e6, (CountingArena.Buffer.copies - copies) / tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--context", type=int, default=1 << 20)
    a = ap.parse_args()
    batches = (1, 8, 64, 128)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(Path(tmp) / "tiny", "tiny")
        engine_step_us(model, 1, a.steps, False, reps=1)     # fills the decode moves, shared by the plan's managers
        engine = {b: engine_step_us(model, b, a.steps, False) for b in batches}
        gpu = {b: engine_step_us(model, b, a.steps, True) for b in batches}
    refresh, _ = decode_tokens(build_plan(from_dict(PRESETS["flash-slice"]), "exact"), a.context, 512)
    flash = from_dict(json.loads((TESTS / "fixtures" / "configs" / "deepseek-v4-flash.json").read_text()))
    flash_us, flash_copies = decode_tokens(build_plan(flash, "exact"), 65536, 512)
    print("| what | µs |\n|---|---|")
    for b in batches:
        print(f"| Engine.step, {b} running (stand-in runner) | {engine[b]:.1f} |")
    for b in batches:
        print(f"| Engine.step, {b} running (GPU runner over host arrays) | {gpu[b]:.1f} |")
    print(f"| place + table refresh per decode token, flash-slice at {a.context} | {refresh:.1f} |")
    print(f"| place + table refresh per decode token, deepseek-v4-flash plan at 65536 | {flash_us:.1f} |")
    print(f"| (its page-table copies to the device per decode token: {flash_copies:.2f}) | |")
    save("host_step", dict(engine_step_us=engine, gpu_runner_step_us=gpu, table_refresh_us=refresh,
                           context=a.context, flash_plan_refresh_us=flash_us, flash_plan_copies=flash_copies))


if __name__ == "__main__":
    main()
