"""The KV cache of a model: its cache kinds, their page geometry and the three page-size classes.

Every kind is paged in units of raw token positions. A page index is `position // positions_per_page`;
a compressed page covers one logical block of 256 positions (256/ratio entries), a window page 64
tokens, a compressor-state page as many tokens as fit in its class page.

Kinds that keep every page (compressed KV, indexer keys) grow with the context. Sliding kinds
(window KV, compressor states) hold only what a step reads or leaves for the next one (see
CacheKind.columns): at most two windows' worth of pages, whatever the context and chunk size.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..config import CSA, HCA, ModelConfig
from .entries import indexer_entry_bytes as index_key_bytes, kv_entry_bytes

BLOCK_POSITIONS = 256      # the scheduler's logical block, in raw positions
WINDOW_PAGE_TOKENS = 64    # a window page then has the size of a c4a compressed page (64 entries)
PAGE_ALIGN = 16            # kernels load 16 B vectors; no vector may straddle two pages
STATE_BYTES = 4            # compressor states (a, z rows) stay float32 in every numerics
LARGE, MEDIUM, SMALL = 0, 1, 2
CLASS_NAMES = ("large", "medium", "small")
NUMERICS = ("exact", "faithful", "fast")   # docs/numerics.md#modes; fast rounds the caches as faithful does
_STORAGE = {2: np.dtype(ml_dtypes.bfloat16), 4: np.dtype(np.float32)}   # element bytes -> the build's type


@dataclass(frozen=True)
class CacheKind:
    name: str
    layers: tuple[int, ...]
    entry_bytes: int           # one compressed entry, or one raw token for window and state kinds
    positions_per_page: int
    page_bytes: int            # what the page's entries fill; the page occupies class_page_bytes
    size_class: int
    class_page_bytes: int
    stride: int = 0            # sliding kinds: the compression ratio (1 for the window)...
    width: int = 0             # ...and the positions one pooled entry or query spans; 0: keeps every page

    @property
    def sliding(self) -> bool:
        return self.width > 0

    def keep_from(self, length: int) -> int:
        """First position that a step starting at `length` reads (kinds that keep every page: 0)."""
        if not self.width:
            return 0
        return max(0, length - length % self.stride + self.stride - self.width)

    def columns(self, length: int, new_len: int) -> list[tuple[int, int]]:
        """Page columns that the step computing positions [length, new_len) needs, as ascending ranges.

        The step reads [keep_from(length), length) from the cache and writes the positions the next
        step reads, [max(length, keep_from(new_len)), new_len); its other positions live only in the
        step's workspace. Column c covers positions [c*P, (c+1)*P) with P = positions_per_page.
        """
        per_page = self.positions_per_page
        if not self.width:
            return [(0, -(-new_len // per_page))] if new_len else []
        ranges = []
        read_from = self.keep_from(length)
        if read_from < length:
            ranges.append((read_from // per_page, -(-length // per_page)))
        write_from = max(length, self.keep_from(new_len))
        if write_from < new_len:
            start, stop = write_from // per_page, -(-new_len // per_page)
            if ranges and start <= ranges[-1][1]:
                start = ranges.pop()[0]
            ranges.append((start, stop))
        return ranges

    def pages(self, n_tokens: int, chunk: int = 1) -> int:
        """Most pages one layer holds while a sequence grows to n_tokens, at most `chunk` per step.

        Sliding kinds: an upper bound. A step reads at most width-1 old positions and writes at most
        width-1; both ranges are one run when the write starts where the read ends.
        """
        per_page = self.positions_per_page
        every = -(-n_tokens // per_page)
        if not self.width:
            return every

        def touched(n: int) -> int:
            return 0 if n <= 0 else (n + per_page - 2) // per_page + 1

        old = self.width - 1
        joined = touched(old + min(chunk, old))
        apart = touched(old) + touched(min(chunk - 1, old))
        return min(every, max(joined, apart))


@dataclass(frozen=True)
class KVPlan:
    numerics: str
    class_page_bytes: tuple[int, int, int]
    kinds: tuple[CacheKind, ...]

    @property
    def bytes_per_token(self) -> float:
        """Asymptotic bytes per raw position: the kinds that keep every page, summed over layers."""
        return sum(k.class_page_bytes * len(k.layers) / k.positions_per_page for k in self.kinds if not k.sliding)

    @property
    def ideal_bytes_per_token(self) -> float:
        """The figure of docs/caches.md#bytes-per-token: entry bytes over compression ratio, without page padding."""
        return sum(k.page_bytes * len(k.layers) / k.positions_per_page for k in self.kinds if not k.sliding)

    def tokens_fitting(self, free_bytes: int) -> int:
        """Raw positions whose growing kinds fit in free_bytes; windows and compressor states, a fixed 18-34 MiB
        per sequence at Flash and Pro sizes, come on top for each sequence."""
        return max(0, int(free_bytes // self.bytes_per_token))

    def class_pages(self, n_tokens: int, chunk: int = 1) -> list[int]:
        """Pages of each class that one sequence holds at most (see CacheKind.pages)."""
        counts = [0, 0, 0]
        for k in self.kinds:
            counts[k.size_class] += len(k.layers) * k.pages(n_tokens, chunk)
        return counts

    def sequence_bytes(self, n_tokens: int, chunk: int = 1) -> int:
        return sum(n * b for n, b in zip(self.class_pages(n_tokens, chunk), self.class_page_bytes))

    def summary(self, n_tokens: int, batch: int = 1, chunk: int = 1) -> dict:
        """The plan of `batch` sequences of n_tokens, fed at most `chunk` tokens a step."""
        kinds = [dict(name=k.name, layers=len(k.layers), entry_bytes=k.entry_bytes,
                      positions_per_page=k.positions_per_page, page_bytes=k.page_bytes,
                      size_class=CLASS_NAMES[k.size_class], class_page_bytes=k.class_page_bytes,
                      page_waste_bytes=k.class_page_bytes - k.page_bytes, pages_per_layer=k.pages(n_tokens, chunk),
                      pages_per_sequence=len(k.layers) * k.pages(n_tokens, chunk),
                      bytes_per_sequence=len(k.layers) * k.pages(n_tokens, chunk) * k.class_page_bytes)
                 for k in self.kinds]
        per_sequence = self.sequence_bytes(n_tokens, chunk)
        return dict(numerics=self.numerics, context=n_tokens, batch=batch, chunk=chunk,
                    bytes_per_token=self.bytes_per_token,
                    ideal_bytes_per_token=self.ideal_bytes_per_token, bytes_per_sequence=per_sequence,
                    overhead_bytes=per_sequence - round(self.ideal_bytes_per_token * n_tokens),
                    total_bytes=batch * per_sequence, size_classes=list(self.class_page_bytes),
                    class_names=list(CLASS_NAMES), kinds=kinds)


def main_entry_bytes(cfg: ModelConfig, numerics: str, element_bytes: int = 2) -> int:
    """One window row or compressed entry as the kernels store it (entries.kv_entry_bytes). element_bytes:
    the build's storage, bf16 (2) or the float32 test build (4), whose faithful entries stay float32 rows."""
    return kv_entry_bytes(_STORAGE[element_bytes], cfg.head_dim, cfg.rope_dim, numerics != "exact")


def indexer_entry_bytes(cfg: ModelConfig, numerics: str, element_bytes: int = 2) -> int:
    """One indexer key as the kernels store it (entries.indexer_entry_bytes): packed e2m1 in faithful (and fast)
    numerics, whatever the build."""
    return index_key_bytes(_STORAGE[element_bytes], cfg.index_head_dim, numerics != "exact")


def default_numerics(cfg: ModelConfig) -> str:
    return "faithful" if cfg.quant else "exact"


def build_plan(cfg: ModelConfig, numerics: str | None = None, element_bytes: int = 2) -> KVPlan:
    numerics = numerics or default_numerics(cfg)
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got '{numerics}'")
    csa, hca = cfg.csa_ratio, cfg.hca_ratio
    for r in (csa, hca):
        if BLOCK_POSITIONS % r:
            raise ValueError(f"compress ratio {r} does not divide the {BLOCK_POSITIONS}-position block")
    main = main_entry_bytes(cfg, numerics, element_bytes)
    index = indexer_entry_bytes(cfg, numerics, element_bytes)
    # Class pages follow from the geometry alone, so a model without c4a or c128a layers still gets
    # three classes (an empty class simply never carves a slab).
    classes = (_round_up(max(WINDOW_PAGE_TOKENS, BLOCK_POSITIONS // csa) * main, PAGE_ALIGN),
               _round_up(BLOCK_POSITIONS // csa * index, PAGE_ALIGN),
               _round_up(BLOCK_POSITIONS // hca * main, PAGE_ALIGN))
    every = tuple(range(cfg.num_layers))
    c4a = tuple(i for i in every if cfg.kinds[i] == CSA)
    c128a = tuple(i for i in every if cfg.kinds[i] == HCA)

    def compressed(name, layers, ratio, entry, cls):
        n = BLOCK_POSITIONS // ratio
        return CacheKind(name, layers, entry, BLOCK_POSITIONS, n * entry, cls, classes[cls])

    def state(name, layers, ratio, overlap, dim, cls):
        per_token = 2 * overlap * dim * STATE_BYTES       # the a and z rows of one token
        tokens = classes[cls] // per_token
        if tokens == 0:
            raise ValueError(f"{name}: one token's state ({per_token} B) exceeds its class page ({classes[cls]} B)")
        return CacheKind(name, layers, per_token, tokens, tokens * per_token, cls, classes[cls],
                         stride=ratio, width=overlap * ratio)

    kinds = [CacheKind("window", every, main, WINDOW_PAGE_TOKENS, WINDOW_PAGE_TOKENS * main, LARGE, classes[LARGE],
                       stride=1, width=cfg.window)]
    if c4a:
        kinds += [compressed("compressed_c4a", c4a, csa, main, LARGE),
                  compressed("indexer", c4a, csa, index, MEDIUM),
                  state("state_main_c4a", c4a, csa, 2, cfg.head_dim, LARGE),
                  state("state_indexer", c4a, csa, 2, cfg.index_head_dim, MEDIUM)]
    if c128a:
        kinds += [compressed("compressed_c128a", c128a, hca, main, SMALL),
                  state("state_c128a", c128a, hca, 1, cfg.head_dim, LARGE)]
    return KVPlan(numerics, classes, tuple(kinds))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
