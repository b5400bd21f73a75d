"""Per-kernel times of one flash-slice decode step or one prefill, for reading under ncu:

  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      python3 bench/step_profile.py MODEL --batch 1 --context 4096 > ncu.csv
  ncu ... python3 bench/step_profile.py MODEL --prefill 8192 > ncu.csv
  python3 bench/step_profile.py --table ncu.csv

A decode step runs eagerly (the same kernels a graph replays), a prefill as `bench prefill` runs it, between
cuProfilerStart and cuProfilerStop."""
from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict


def profile(model_dir: str, batch: int, context: int) -> None:
    import numpy as np
    from cuda.bindings import driver

    from dsv4rt.benchmarks import BF16, _fill_random, _greedy, _kv_bytes
    from dsv4rt.cuda.runtime import Runtime
    from dsv4rt.model.forward import Entry, GpuModel

    with Runtime() as rt:
        m = GpuModel(model_dir, BF16, runtime=rt, max_len=context + 64, kv_bytes=_kv_bytes(model_dir, context, batch),
                     max_batch=batch, step_rows=batch)
        _fill_random(m)
        entries = [Entry(r, np.zeros(1, np.int32), context) for r in range(batch)]
        for r in range(batch):
            m.blocks.place(r, context)
            m.blocks.place(r, context + 1)
            m.tables.refresh(r, m.blocks, r, rt.stream)
        for profiled in (False, True):          # the first step loads every kernel
            m.upload(entries, pad_to=batch, sampling=_greedy(batch))
            rt.stream.synchronize()
            if profiled:
                driver.cuProfilerStart()
            m.launch(batch, batch, True)
            rt.stream.synchronize()
            if profiled:
                driver.cuProfilerStop()


def profile_prefill(model_dir: str, tokens: int) -> None:
    import numpy as np
    from cuda.bindings import driver

    from dsv4rt.benchmarks import BF16, _kv_bytes
    from dsv4rt.cuda.runtime import Runtime
    from dsv4rt.model.forward import GpuModel

    with Runtime() as rt:
        m = GpuModel(model_dir, BF16, runtime=rt, max_len=tokens + 1, kv_bytes=_kv_bytes(model_dir, tokens, 1))
        ids = np.random.default_rng(tokens).integers(2, m.cfg.vocab_size, tokens)
        m.forward(ids[:300], last_only=True)     # loads every kernel
        m.reset()
        rt.stream.synchronize()
        driver.cuProfilerStart()
        m.forward(ids, last_only=True)
        rt.stream.synchronize()
        driver.cuProfilerStop()


def table(path: str) -> None:
    """Kernel times summed by name (template arguments dropped), largest first."""
    total, count = defaultdict(float), defaultdict(int)
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"<.*", "", row["Kernel Name"]).split("(")[0]
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[row["Metric Unit"]]
        us = float(row["Metric Value"].replace(",", "")) * scale
        total[name] += us
        count[name] += 1
    step = sum(total.values())
    print(f"| kernel | launches | µs | share |\n|---|---|---|---|")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"| {name[:60]} | {count[name]} | {us:.1f} | {us / step:.3f} |")
    print(f"| total | {sum(count.values())} | {step:.1f} | 1.000 |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, help="profile a prefill of this many tokens instead")
    ap.add_argument("--table")
    a = ap.parse_args()
    if a.table:
        table(a.table)
    elif a.prefill:
        profile_prefill(a.model, a.prefill)
    else:
        profile(a.model, a.batch, a.context)
