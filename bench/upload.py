"""Weight upload GB/s against the pinned host-to-device copy peak.

usage: python bench/upload.py [--model DIR] [--gib 4]
Without --model, writes a synthetic checkpoint of --gib GiB (bf16 tensors of 64 MiB) to a temp folder.
Prints a table and writes bench/results/upload.json.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from results import save
from dsv4rt.cuda.arena import PinnedBuffer
from dsv4rt.cuda.device import Event
from dsv4rt.cuda.runtime import Runtime
from dsv4rt.loader import SafetensorsFile
from dsv4rt.loader.upload import STAGING, layout


class RawCheckpoint:
    """Every tensor of the safetensors files in a folder, for timing only (no config needed)."""

    def __init__(self, folder: Path):
        self.files = [SafetensorsFile(p) for p in sorted(folder.glob("*.safetensors"))]
        self.where = {n: f for f in self.files for n in f.tensors}

    def names(self):
        return list(self.where)

    def raw(self, name):
        return self.where[name].array(name)


def synthetic(folder: Path, gib: float) -> Path:
    rng = np.random.default_rng(0)
    block = rng.standard_normal((4096, 8192)).astype(ml_dtypes.bfloat16)  # 64 MiB
    n = int(gib * 16)
    for shard in range(0, n, 8):
        save_file({f"t{i}": block for i in range(shard, min(n, shard + 8))}, str(folder / f"s{shard}.safetensors"))
    return folder


def pinned_peak(rt, nbytes: int, repeats: int = 5) -> float:
    src = PinnedBuffer(nbytes)
    dst = rt.arena.alloc(nbytes)
    src.array[:] = 1
    times = []
    for _ in range(repeats):
        a, b = Event(), Event()
        rt.stream.record(a)
        dst.copy_from_host(src.array, rt.stream)
        rt.stream.record(b)
        b.synchronize()
        times.append(a.elapsed_ms(b) / 1e3)
    src.close()
    dst.free()
    return nbytes / statistics.median(times) / 1e9


def main():
    from dsv4rt.loader.upload import upload
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Runtime(arena_bytes=int((a.gib + 2) * 2**30)) as rt:
        folder = Path(a.model) if a.model else synthetic(Path(tmp), a.gib)
        ck = RawCheckpoint(folder)
        total = layout(ck, ck.names())[1]
        peak = pinned_peak(rt, STAGING * 4)
        runs = []
        for _ in range(a.repeats):  # the first run reads from disk, later ones from the page cache
            t = time.perf_counter()
            w = upload(ck, rt.arena, rt.stream, progress=False)
            runs.append(time.perf_counter() - t)
            w.buffer.free()
    rates = [total / s / 1e9 for s in runs]
    res = dict(bytes=total, pinned_h2d_peak_gbps=round(peak, 2), upload_gbps_first=round(rates[0], 2),
               upload_gbps_median=round(statistics.median(rates), 2),
               fraction_of_peak=round(statistics.median(rates) / peak, 3))
    print(f"{'what':34s} {'GB/s':>8s}")
    print(f"{'pinned host->device copy (peak)':34s} {peak:8.2f}")
    print(f"{'upload, first run (disk)':34s} {rates[0]:8.2f}")
    print(f"{'upload, median (page cache)':34s} {statistics.median(rates):8.2f}")
    print(f"{'fraction of peak':34s} {statistics.median(rates) / peak:8.3f}")
    save("upload", res)


if __name__ == "__main__":
    main()
