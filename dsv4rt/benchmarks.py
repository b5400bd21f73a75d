"""What `dsv4rt bench` measures (see dsv4rt/cli/bench.py): decode step times against the HBM roofline,
prefill throughput, and a serving run's throughput and latencies. GPU only."""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np

from .cuda.device import Event
from .cuda.runtime import Runtime
from .kv.blocks import OutOfPages
from .kv.plan import build_plan
from .loader import Checkpoint
from .model.forward import Entry, GpuModel
from .model.graphs import DecodeGraphs
from .model.inputs import SamplingArrays
from .model.roofline import decode_bytes, prefill_flops

BF16 = np.dtype(ml_dtypes.bfloat16)
SLAB_SLACK = 3 * (2 << 20)      # a partly used slab per size class


def _kv_bytes(model_dir, context: int, batch: int) -> int:
    with Checkpoint.open(model_dir) as ck:
        plan = build_plan(ck.config, "exact", element_bytes=BF16.itemsize)
    return int(batch * plan.sequence_bytes(context + 2) * 1.02) + SLAB_SLACK


def _weights_bytes(model_dir) -> int:
    from pathlib import Path
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _greedy(n: int) -> SamplingArrays:
    return SamplingArrays(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                          np.zeros(n, np.uint64), np.zeros(n, np.uint64))


def _fill_random(model: GpuModel) -> None:
    """Every KV byte as random bf16 values (compressor states read them in pairs: finite floats too)."""
    import cupy as cp
    n = model.kv.nbytes // 2
    words = cp.ndarray((n,), cp.uint16, cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(model.kv.ptr, model.kv.nbytes, model), 0))
    chunk = 1 << 28
    for a in range(0, n, chunk):
        x = cp.random.standard_normal(min(chunk, n - a), dtype=cp.float32) * 0.5
        words[a:a + len(x)] = (x.view(cp.uint32) >> 16).astype(cp.uint16)
    cp.cuda.Device().synchronize()


def decode(model_dir, batches: list[int], contexts: list[int], reps: int, copy_gbps: float) -> list[dict]:
    rows = []
    for C in contexts:
        with Runtime() as rt:
            B_max = max(batches)
            kv = min(_kv_bytes(model_dir, C, B_max), rt.arena.size - _weights_bytes(model_dir) - (8 << 30))
            m = GpuModel(model_dir, BF16, runtime=rt, max_len=C + 64, kv_bytes=kv, max_batch=B_max,
                         step_rows=1 << (B_max - 1).bit_length())
            sizes = {name: a.nbytes for name, a in m.w.items()}
            graphs = DecodeGraphs(m)
            _fill_random(m)
            placed = 0
            for B in sorted(batches):
                try:
                    for r in range(placed, B):
                        m.blocks.place(r, C)
                        m.blocks.place(r, C + 1)
                        placed += 1
                except OutOfPages:
                    rows.append(dict(batch=B, context=C, note=f"does not fit ({kv / 2**30:.1f} GiB of KV)"))
                    continue
                rows.append(_time_decode(m, graphs, B, C, reps, copy_gbps, sizes))
            graphs.close()
    return rows


def _time_decode(m: GpuModel, graphs: DecodeGraphs, B: int, C: int, reps: int, copy_gbps: float, sizes) -> dict:
    entries = [Entry(r, np.zeros(1, np.int32), C) for r in range(B)]
    for r in range(B):
        m.tables.refresh(r, m.blocks, r, m.rt.stream)
    sampling = _greedy(B)
    graphs.run(entries, sampling)
    graphs.run(entries, sampling)                # the first run of a tier captures its graph
    graph, st = graphs.graphs[graphs.tier(B)], m.rt.stream
    times, host = [], []
    start, end = Event(), Event()
    for _ in range(reps):
        t0 = time.perf_counter()
        for r in range(B):
            m.tables.refresh(r, m.blocks, r, st)
        m.upload(entries, pad_to=graphs.tier(B), sampling=sampling)
        t1 = time.perf_counter()
        st.record(start)              # after the inputs' copy: the step's GPU time alone
        t2 = time.perf_counter()
        graph.replay(st)
        host.append(time.perf_counter() - t2 + t1 - t0)
        st.record(end)
        end.synchronize()
        times.append(start.elapsed_ms(end))
    step = float(np.median(times))
    nbytes = decode_bytes(m.cfg, sizes, B, C, m.dtype.itemsize)
    roof = nbytes / (copy_gbps * 1e9) * 1e3
    return dict(batch=B, context=C, step_ms=step, roofline_ms=roof, fraction=roof / step,
                host_us=float(np.median(host)) * 1e6, gbps=nbytes / step / 1e6, note="")


def prefill_row(cfg, tokens: int, seconds: float, ceiling_tflops: float, note: str = "") -> dict:
    flops = prefill_flops(cfg, tokens)
    tflops = flops / seconds / 1e12
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, gflop_per_token=flops / tokens / 1e9,
                tflops=tflops, fraction=tflops / ceiling_tflops, note=note)


REPEATED_PREFILL = 65536  # longer prompts run once, unwarmed: a 1M-token one takes about a minute


def prefill(model_dir, lengths: list[int], ceiling_tflops: float, reps: int = 3) -> list[dict]:
    """Each length: one run to warm (cuBLAS's heuristics and the kernels of that step shape), then the median of
    `reps` timed runs; lengths above REPEATED_PREFILL one timed run."""
    rows = []
    with Runtime() as rt:
        L = max(lengths)
        m = GpuModel(model_dir, BF16, runtime=rt, max_len=L + 1, kv_bytes=_kv_bytes(model_dir, L, 1))
        m.forward(np.arange(2, 300), last_only=True)     # loads every kernel
        for T in lengths:
            ids = np.random.default_rng(T).integers(2, m.cfg.vocab_size, T)
            times = []
            for _ in range(1 + reps if T <= REPEATED_PREFILL else 1):
                m.reset()
                t0 = time.perf_counter()
                m.forward(ids, last_only=True)
                times.append(time.perf_counter() - t0)
            timed = times[1:] or times
            note = f"steps of {m.rows}, " + (f"median of {len(timed)}" if len(timed) > 1 else "one run")
            rows.append(prefill_row(m.cfg, T, float(np.median(timed)), ceiling_tflops, note))
    return rows


def serve(model_dir, n: int, prompt_len: list[int], output_len: list[int], max_running: int, max_batched_tokens: int,
          seed: int) -> dict:
    from .engine import Engine
    from .reference.sampling import SamplingParams
    from .server.load import latencies, workload
    work = workload(n, prompt_len, output_len, seed)       # what `bench serve --url` sends
    hi, out_hi = prompt_len[1], output_len[1]
    kv = _kv_bytes(model_dir, hi + out_hi, min(n, max_running))
    e = Engine(model_dir, "cuda", kv_bytes=kv, max_running=max_running, max_len=hi + out_hi + 8,
               max_batched_tokens=max_batched_tokens)
    e.warm_up()
    t0 = time.perf_counter()
    ids = [e.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=k)) for prompt, k in work]
    requests = [e._live[i] for i in ids]
    while e.has_unfinished():
        e.step()
    wall = time.perf_counter() - t0
    generated = sum(len(r.token_times) for r in requests)
    return dict(requests=n, prompt_tokens=sum(len(p) for p, _ in work), generated=generated, seconds=wall,
                tokens_per_s=generated / wall, **latencies([(r.arrived, r.token_times) for r in requests]),
                preemptions=e.scheduler.preemptions)
