"""Decode steps (one token per request) as CUDA graphs, one per batch tier.

A step of n requests runs as the smallest tier B >= n, padded with rows of request −1 that every
kernel skips or computes harmlessly; the inputs buffer is refilled before each replay. Eager decode
steps pad the same way, so outputs do not depend on whether graphs are on. Batches above the largest
tier run eagerly at their own size."""
from __future__ import annotations

from ..cuda.device import Graph
from .forward import Entry, GpuModel
from .inputs import SamplingArrays

TIERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecodeGraphs:
    def __init__(self, model: GpuModel, enabled: bool = True):
        self.model, self.enabled = model, enabled
        # up to the first tier that holds max_batch requests, where the workspace has its rows
        top = next((t for t in TIERS if t >= model.max_batch), TIERS[-1])
        self.tiers = [t for t in TIERS if t <= min(top, model.rows) or t == 1]
        self.graphs: dict[int, Graph] = {}

    def tier(self, n: int) -> int | None:
        return next((t for t in self.tiers if t >= n), None)

    def run(self, entries: list[Entry], sampling: SamplingArrays):
        """Sampled tokens of a decode step."""
        m, n = self.model, len(entries)
        B = self.tier(n)
        if B is None:
            return m.run(entries, sampling=sampling)
        m.upload(entries, pad_to=B, sampling=sampling)
        graph = self.graphs.get(B) if self.enabled else None
        if graph is None:
            m.launch(B, B, True)            # eager; the first run of a tier also loads its kernels
        else:
            graph.replay(m.rt.stream)
        tokens = m.outputs(n, sampled=True)
        if self.enabled and B not in self.graphs:
            self.graphs[B] = self._capture(B)
        return tokens

    def _capture(self, B: int) -> Graph:
        graph = Graph(self.model.rt.stream)
        with graph:
            self.model.launch(B, B, True)
        return graph

    def close(self):
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
