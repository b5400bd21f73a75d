"""The parallel layout of docs/parallel.md: what each of N GPUs of one host holds of every checkpoint tensor.

Rank r holds the heads [r·H/N, (r+1)·H/N) (their rows of wq_b, their sinks), the wo_a rows of its groups
(with N > G, ranks share a group and each holds the wo_a columns of its own heads), the slice r of wo_b's
G·o_lora input columns, the routed experts [r·E/N, (r+1)·E/N) and the vocabulary rows [r·V/N, (r+1)·V/N) of
the embedding and the head. Everything else is replicated (the reasons are in docs/parallel.md)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..config import ModelConfig
from ..loader import expected_shapes, fp4_scale_shape, fp8_scale_shape, scale_name
from ..loader.formats import FP4_BLOCK, FP8_BLOCK
from ..loader.names import released_format

ELEMENT_BYTES = {"bf16": 2, "fp32": 4, "int32": 4}

_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_ATTN = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    cfg: ModelConfig
    n: int

    def __post_init__(self):
        c, n = self.cfg, self.n
        if n < 1:
            raise LayoutError(f"the GPU count must be at least 1, got {n}")
        for what, count in (("attention heads", c.num_heads), ("routed experts", c.n_experts)):
            if count % n:
                raise LayoutError(f"cannot split {count} {what} over {n} GPUs: {n} must divide {count}")
        G = c.o_groups
        if (G % n if n <= G else n % G) or c.o_lora_rank % max(n // G, 1):
            raise LayoutError(f"cannot split {G} output groups of rank {c.o_lora_rank} over {n} GPUs: one of "
                              f"{G} and {n} must divide the other, and the GPUs sharing a group its rank")

    @property
    def heads_per_rank(self) -> int:
        return self.cfg.num_heads // self.n

    @property
    def ranks_per_group(self) -> int:
        """Ranks that share one output group: 1 while N <= G."""
        return max(self.n // self.cfg.o_groups, 1)

    def heads(self, r: int) -> tuple[int, int]:
        return r * self.heads_per_rank, (r + 1) * self.heads_per_rank

    def experts(self, r: int) -> tuple[int, int]:
        per = self.cfg.n_experts // self.n
        return r * per, (r + 1) * per

    def vocab(self, r: int) -> tuple[int, int]:
        V = self.cfg.vocab_size
        return r * V // self.n, (r + 1) * V // self.n

    def wo_b_columns(self, r: int) -> tuple[int, int]:
        """The slice of t = wo_a's output [T, G·o_lora] that rank r multiplies by wo_b."""
        width = self.cfg.o_groups * self.cfg.o_lora_rank // self.n
        return r * width, (r + 1) * width

    def wo_a(self, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Rows (output) and columns (input) of wo_a [G·o_lora, (H/G)·hd] that rank r holds."""
        c, k = self.cfg, self.ranks_per_group
        ol, width = c.o_lora_rank, c.num_heads * c.head_dim // c.o_groups
        if k == 1:
            groups = c.o_groups // self.n
            return (r * groups * ol, (r + 1) * groups * ol), (0, width)
        g, j = divmod(r, k)
        return (g * ol, (g + 1) * ol), (j * width // k, (j + 1) * width // k)

    def tokens(self, T: int, r: int) -> tuple[int, int]:
        """The tokens of a step that rank r owns between attentions (docs/parallel.md#a-step)."""
        return r * T // self.n, (r + 1) * T // self.n

    def index(self, name: str, shape: tuple[int, ...], r: int) -> tuple[tuple[int, int], ...] | None:
        """Rank r's slice of a tensor, one (start, stop) per dimension of its logical shape; None if it holds none."""
        whole = tuple((0, s) for s in shape)
        if m := _EXPERT.match(name):
            lo, hi = self.experts(r)
            return whole if lo <= int(m.group(1)) < hi else None
        if name in ("embed.weight", "head.weight"):
            return (self.vocab(r),) + whole[1:]
        m = _ATTN.match(name)
        if m is None:
            return whole
        part = m.group(1)
        if part == "wq_b.weight":
            h0, h1 = self.heads(r)
            return (h0 * self.cfg.head_dim, h1 * self.cfg.head_dim), whole[1]
        if part == "attn_sink":
            return (self.heads(r),)
        if part == "wo_a.weight":
            return self.wo_a(r)
        return whole[0], self.wo_b_columns(r)

    def local_name(self, name: str, r: int) -> str:
        """The name rank r's own model gives a tensor it holds: its routed experts are numbered from 0."""
        m = _EXPERT.match(name)
        if m is None:
            return name
        return f"{name[:m.start(1)]}{int(m.group(1)) - self.experts(r)[0]}{name[m.end(1):]}"

    def shards(self, r: int) -> dict[str, tuple[tuple[int, int], ...]]:
        """Every tensor rank r holds (official names, docs/formats.md#tensor-names) with its slice."""
        out = {}
        for name, shape in expected_shapes(self.cfg).items():
            idx = self.index(name, shape, r)
            if idx is not None:
                out[name] = idx
        return out

    def bytes_per_rank(self) -> list[int]:
        """Bytes each rank holds in the released formats (fp8 attention, fp4 experts, scales included)."""
        out = [0] * self.n
        for name, shape in expected_shapes(self.cfg).items():
            fmt = released_format(name)
            for r in range(self.n):
                idx = self.index(name, shape, r)
                if idx is not None:
                    out[r] += stored_bytes(fmt, tuple(b - a for a, b in idx))
        return out


def stored_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of logical `shape` stored as `fmt`, its e8m0 scales included."""
    count = math.prod(shape)
    if fmt == "fp8":
        return count + math.prod(fp8_scale_shape(shape))
    if fmt == "fp4":
        return count // 2 + math.prod(fp4_scale_shape(shape))
    return count * ELEMENT_BYTES[fmt]


def stored_slices(name: str, fmt: str, shape: tuple[int, ...], idx) -> dict[str, tuple[slice, ...]]:
    """The slices of the stored tensors (the weight and, for fp8/fp4, its `.scale`) that hold the logical slice
    `idx` of `name`. A quantised slice must start and end on its scale blocks, else the rank would need part of
    another rank's block."""
    if fmt not in ("fp8", "fp4"):
        return {name: tuple(slice(a, b) for a, b in idx)}
    (r0, r1), (c0, c1) = idx
    rows, cols = (FP8_BLOCK, FP8_BLOCK) if fmt == "fp8" else (1, FP4_BLOCK)
    for what, (a, b), block, full in (("rows", (r0, r1), rows, shape[0]), ("columns", (c0, c1), cols, shape[1])):
        if a % block or (b % block and b != full):
            raise LayoutError(f"{name}: {what} {a}:{b} do not fall on the {block}-wide blocks of its {fmt} scales")
    scale = scale_name(name)
    weight_cols = slice(c0, c1) if fmt == "fp8" else slice(c0 // 2, c1 // 2)
    return {name: (slice(r0, r1), weight_cols),
            scale: (slice(r0 // rows, -(-r1 // rows)), slice(c0 // cols, -(-c1 // cols)))}
