"""The GPU model runner: a scheduled step becomes one batched forward, sampled on the device.

Each running request owns a slot (its row of the page tables); decode steps replay CUDA graphs. The
prefix cache's snapshots are device copies of the pages a request holds at a block boundary (the
compressed entries, the window and the compressor states), copied back into a resuming request's pages."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import ml_dtypes
import numpy as np

from ..cuda.arena import OutOfArena
from ..cuda.driver import check, drv
from ..kv.slab import DEFAULT_SLAB_BYTES
from ..model.forward import Entry, GpuModel
from ..model.graphs import DecodeGraphs
from ..model.inputs import DecodeRows, SamplingArrays
from .request import Request
from .scheduler import Step

DTYPES = {"bf16": ml_dtypes.bfloat16, "float32": np.float32}


@dataclass
class Snapshot:
    buffer: object                                   # arena buffer holding the pages' bytes
    pages: list[tuple[str, int, int, int, int]]      # (kind, layer, column, offset in buffer, bytes)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


class GpuRunner:
    def __init__(self, model: GpuModel, graphs: bool = True):
        self.model = model
        self.graphs = DecodeGraphs(model, graphs)
        self.keep_logits = False        # tests: keep each sampled request's logits in self.logits
        self.logits: dict[Hashable, np.ndarray] = {}
        self.slots: dict[Hashable, int] = {}
        self.free_slots = list(range(model.max_batch - 1, -1, -1))
        # each slot's sampling settings, written when a request takes it: a step gathers those of its rows
        B = model.max_batch
        self.temperature, self.top_k = np.zeros(B, np.float32), np.zeros(B, np.int32)
        self.top_p, self.seed = np.ones(B, np.float32), np.zeros(B, np.uint64)

    @classmethod
    def build(cls, model_dir, dtype: str, kv_bytes: int, max_running: int, token_budget: int, max_len: int,
              graphs: bool = True, runtime=None, numerics: str | None = None,
              slab_bytes: int = DEFAULT_SLAB_BYTES) -> "GpuRunner":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        model = GpuModel(model_dir, DTYPES[dtype], runtime=runtime, max_len=max_len, kv_bytes=kv_bytes,
                         max_batch=max_running, step_rows=max(token_budget, max_running), slab_bytes=slab_bytes,
                         numerics=numerics)
        return cls(model, graphs)

    def run(self, step: Step) -> list[int]:
        m = self.model
        tables, blocks, stream = m.tables, m.blocks, m.rt.stream
        shown, version = tables.versions, blocks.version
        slots, ids, pos, generated, tokens = [], [], [], [], 0
        for request, n in step:
            slot = self.slots.get(request.id)
            if slot is None:
                slot = self._take_slot(request)
            if shown[slot] != version(request.id):     # the refresh's own check, without a call per request
                tables.refresh(slot, blocks, request.id, stream)
            slots.append(slot)
            ids.append(request.token(request.computed))
            pos.append(request.computed)
            generated.append(len(request.generated))
            tokens += n
        slot = np.array(slots, np.int32)
        sampling = SamplingArrays(self.temperature[slot], self.top_k[slot], self.top_p[slot], self.seed[slot],
                                  np.array(generated, np.uint64))
        if tokens == len(step):
            out = self.graphs.run(DecodeRows(slot, np.array(ids, np.int32), np.array(pos, np.int32)), sampling)
        else:
            entries = [Entry(s, np.asarray(r.tokens(r.computed, r.computed + n), np.int32), r.computed)
                       for s, (r, n) in zip(slots, step)]
            out = m.run(entries, sampling=sampling)
        if self.keep_logits:
            self.logits.update(zip((r.id for r, _ in step), m.outputs(len(step))))
        return out.tolist()

    def _take_slot(self, request: Request) -> int:
        if not self.free_slots:        # preempted requests hold no pages: their slots are free
            for other in [k for k in self.slots if k not in self.model.blocks]:
                self.release(other)
        slot = self.slots[request.id] = self.free_slots.pop()
        p = request.params
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = p.temperature, p.top_k, p.top_p
        self.seed[slot] = request.sample_seed
        return slot

    def release(self, request_id: Hashable) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.model.tables.forget(slot)
            self.free_slots.append(slot)

    def snapshot(self, request_id: Hashable) -> Snapshot | None:
        """A copy of the pages the request holds now; None when the arena has no room for it."""
        m = self.model
        pages, sources, total = [], [], 0
        for (kind, layer), (_, _, k) in m.tables.at.items():
            for col, page in enumerate(m.blocks.table(request_id, kind, layer)):
                if page >= 0:
                    pages.append((kind, layer, col, total, k.page_bytes))
                    sources.append(m.allocator.offset(int(page)))
                    total += -(-k.page_bytes // 256) * 256
        try:
            buffer = m.rt.arena.alloc(max(total, 256), "prefix snapshot")
        except OutOfArena:
            return None
        for (_, _, _, at, nbytes), source in zip(pages, sources):
            self._copy(buffer.ptr + at, m.kv.ptr + source, nbytes)
        return Snapshot(buffer, pages)

    def restore(self, request_id: Hashable, snapshot: Snapshot) -> None:
        """Copy a snapshot into the pages the request holds (those it lacks, it does not read)."""
        m = self.model
        tables = {}
        for kind, layer, col, at, nbytes in snapshot.pages:
            table = tables.get((kind, layer))
            if table is None:
                table = tables[kind, layer] = m.blocks.table(request_id, kind, layer)
            if col < len(table) and table[col] >= 0:
                self._copy(m.kv.ptr + m.allocator.offset(int(table[col])), snapshot.buffer.ptr + at, nbytes)

    def discard(self, snapshot: Snapshot) -> None:
        snapshot.buffer.free()

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        check(drv().cuMemcpyDtoDAsync(dst, src, nbytes, self.model.rt.stream.handle))

    def close(self):
        self.graphs.close()
