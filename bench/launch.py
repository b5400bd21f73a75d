"""Host time per decode-sized step: eager launches against one CUDA graph replay.

A Flash decode step issues roughly 1,000 small kernels (43 layers x ~25 launches); this times a
step of --launches rmsnorm launches over a batch-sized tensor, eager and as a replayed graph.
usage: python bench/launch.py [--launches 1000] [--rows 8] [--repeats 30]
Prints a table and writes bench/results/launch.json.
"""
import argparse
import statistics
import time

import ml_dtypes  # noqa: F401  (registers the bfloat16 dtype name)
import numpy as np

from results import save
from dsv4rt.cuda import ops
from dsv4rt.cuda.device import Event, Graph
from dsv4rt.cuda.runtime import Runtime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    with Runtime(arena_bytes=64 << 20) as rt:
        x = rt.arena.alloc(a.rows * a.dim * 2)
        x.copy_from_host(np.ones(a.rows * a.dim, np.uint16) * 0x3F80)  # bf16 1.0
        launch = ops.rmsnorm(rt.device, "bfloat16", x.ptr, x.ptr, None, a.rows, a.dim, 1e-6)

        def step():
            for _ in range(a.launches):
                launch(rt.stream)

        def measure(run):
            host, device = [], []
            for _ in range(a.repeats):
                s, e = Event(), Event()
                rt.stream.record(s)
                t = time.perf_counter()
                run()
                host.append(time.perf_counter() - t)
                rt.stream.record(e)
                e.synchronize()
                device.append(s.elapsed_ms(e) / 1e3)
            return statistics.median(host), statistics.median(device)

        step()
        rt.stream.synchronize()
        eager = measure(step)
        graph = Graph(rt.stream)
        with graph:
            step()
        graph.replay()
        rt.stream.synchronize()
        replay = measure(graph.replay)
        graph.close()
    rows = [("eager launches", *eager), ("graph replay", *replay)]
    print(f"{a.launches} launches of rmsnorm [{a.rows} x {a.dim}] bf16 per step, median of {a.repeats}")
    print(f"{'mode':16s} {'host us/step':>14s} {'host us/launch':>15s} {'GPU us/step':>12s}")
    for name, h, d in rows:
        print(f"{name:16s} {h * 1e6:14.1f} {h * 1e6 / a.launches:15.2f} {d * 1e6:12.1f}")
    res = dict(launches=a.launches, rows=a.rows, dim=a.dim,
               eager_host_us=round(eager[0] * 1e6, 1), eager_gpu_us=round(eager[1] * 1e6, 1),
               graph_host_us=round(replay[0] * 1e6, 1), graph_gpu_us=round(replay[1] * 1e6, 1))
    save("launch", res)


if __name__ == "__main__":
    main()
