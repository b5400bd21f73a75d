"""Checkpoint → arena: disk reads into pinned staging buffers overlapped with asynchronous copies."""
from __future__ import annotations

import bisect
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..cuda.arena import ALIGN, Arena, Buffer, DeviceArray, PinnedBuffer
from ..cuda.device import Event, Stream
from .checkpoint import Checkpoint

STAGING = 256 << 20
PIECE = 8 << 20  # one thread's share of a staging fill: numpy copies release the GIL
SHOW_PROGRESS_ABOVE = 1 << 30


@dataclass
class DeviceWeights:
    buffer: Buffer
    arrays: dict[str, DeviceArray]  # official name -> the stored tensor (dtype and shape as on disk)
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def layout(ck: Checkpoint, names) -> tuple[dict[str, int], int]:
    """Byte offset of each tensor inside one buffer, each aligned for vector loads."""
    offsets, at = {}, 0
    for n in names:
        offsets[n] = at
        at += -(-ck.raw(n).nbytes // ALIGN) * ALIGN
    return offsets, at


def _pieces(ck: Checkpoint, order: list[str], starts: list[int], start: int, end: int):
    """(source bytes, offset in the fill) for the destination range [start, end), cut for threads."""
    first = max(0, bisect.bisect_right(starts, start) - 1)
    for n, at in zip(order[first:], starts[first:]):
        if at >= end:
            return
        src = ck.raw(n).reshape(-1).view(np.uint8)
        lo, hi = max(start, at), min(end, at + len(src))
        for a in range(lo, hi, PIECE):
            yield src[a - at:min(hi, a + PIECE) - at], a - start


def _fill(stage: np.ndarray, piece) -> None:
    src, at = piece
    stage[at:at + len(src)] = src  # the disk read happens here, in parallel threads


def upload(ck: Checkpoint, arena: Arena, stream: Stream, names=None, staging: int = STAGING,
           progress: bool | None = None, threads: int | None = None) -> DeviceWeights:
    """Copy the stored tensors as they are (no dequantisation) into one arena buffer. While the DMA
    engine copies one staging buffer, host threads fill the other from the memory-mapped files."""
    names = list(names or ck.names())
    offsets, total = layout(ck, names)
    buf = arena.alloc(total, "weights")
    t0 = time.perf_counter()
    size = min(staging, max(total, ALIGN))
    stages = [PinnedBuffer(size) for _ in range(2)]
    done = [Event(timing=False), Event(timing=False)]
    bar = _bar(total, progress)
    pool = ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1))
    order = sorted(names, key=offsets.__getitem__)
    starts = [offsets[n] for n in order]
    try:
        for i, start in enumerate(range(0, total, size)):
            end, stage = min(total, start + size), stages[i % 2]
            done[i % 2].synchronize()  # this stage's previous copy has finished
            list(pool.map(partial(_fill, stage.array), _pieces(ck, order, starts, start, end)))
            buf.copy_from_host(stage.array[:end - start], stream, offset=start)
            stream.record(done[i % 2])
            if bar:
                bar.update(end - start)
        stream.synchronize()
    except BaseException:
        buf.free()
        raise
    finally:
        pool.shutdown()
        for s in stages:
            s.close()
        for e in done:
            e.close()
        if bar:
            bar.close()
    seconds = time.perf_counter() - t0
    if bar:
        print(f"uploaded {total / 1e9:.2f} GB in {seconds:.1f} s ({total / seconds / 1e9:.2f} GB/s)", file=sys.stderr)
    arrays = {n: DeviceArray(buf.ptr + offsets[n], ck.raw(n).shape, ck.raw(n).dtype, buf) for n in names}
    return DeviceWeights(buf, arrays, total, seconds)


def _bar(total: int, progress: bool | None):
    if progress is None:
        progress = total >= SHOW_PROGRESS_ABOVE and sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="uploading weights", file=sys.stderr)
