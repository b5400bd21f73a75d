"""The DeepSeek V4 forward on the GPU for one request: the per-layer launch sequence over paged caches.

Every kernel is a template over the storage type, so `GpuModel(dir, np.float32)` runs the same code
as the bf16 build and is checked tightly against the numpy reference. Faithful numerics
(docs/numerics.md) read fp8/fp4 weights as stored, quantise the inputs of their GEMMs and keep the main cache
in fp8 and the indexer keys in fp4; fast numerics quantise wo_a's input too."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..config import CSA, SLIDING
from ..cuda import ops
from ..cuda.device import Event, Stream
from ..cuda.runtime import Runtime
from ..kv import NUMERICS, BlockManager, SlabAllocator, build_plan
from ..kv.plan import default_numerics
from ..kv.slab import DEFAULT_SLAB_BYTES
from ..loader import Checkpoint, scale_name
from . import attention as attn_k
from . import compress as comp_k
from . import fp8
from . import hc as hc_k
from . import sample as sample_k
from .inputs import StepInputs
from .memory import (BUILD_BLAS, SCORES_BUDGET, attention_splits, index_entries, moe_dims, score_rows, step_shape,
                     tensor_core_attention, workspace_sizes)
from .paged import LaunchSequence, PagedCache
from .tables import PageTables
from .gemm import Blas, grouped_linear, linear
from .gemm_w8a16 import w8a16_fits, w8a16_gemm
from .linear_fp8 import SKINNY_ROWS, linear_fp8, released_formats
from .moe import ExpertWeights, MoE, MoeDims, pointer_table
from .moe_fp4 import Fp4Experts, Fp4MoE, Fp8Expert
from .weights import load_weights

F32 = np.dtype(np.float32)


class Workspace:
    """Named scratch arrays carved from one arena buffer, sized for `rows` tokens per step."""

    def __init__(self, arena, sizes: dict[str, int]):
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name] = at
            at += -(-max(size, 1) // 256) * 256
        self.buffer = arena.alloc(at, "workspace")
        self.ptr = {name: self.buffer.ptr + off for name, off in offsets.items()}

    def __getitem__(self, name: str) -> int:
        return self.ptr[name]


@dataclass(frozen=True)
class Entry:
    """One request's tokens in a step: `ids` at positions [start, start + len(ids)) of request slot `slot`."""
    slot: int
    ids: np.ndarray
    start: int


class GpuModel:
    """The forward for up to `max_batch` requests at once (one request slot each), at most `step_rows`
    tokens per step (by default memory.STEP_TOKENS, at most max_len) and `max_len` positions per request. A
    request's tokens in one step may fill it: attention takes the step's own window keys
    from the step's rows and earlier ones from the window cache, whose pages the block manager holds
    only for what a step reads or leaves to the next (dsv4rt/kv/blocks.py).
    `numerics` exact, faithful or fast; by default faithful for checkpoints stored in fp8/fp4. The indexer's
    scores of a step take at most `scores_budget` bytes (memory.SCORES_BUDGET)."""

    def __init__(self, model_dir, dtype=ml_dtypes.bfloat16, *, runtime: Runtime | None = None,
                 max_len: int = 4096, kv_bytes: int = 256 << 20, max_batch: int = 1, step_rows: int | None = None,
                 slab_bytes: int = DEFAULT_SLAB_BYTES, numerics: str | None = None,
                 scores_budget: int = SCORES_BUDGET):
        self.dtype = np.dtype(dtype)
        self.rt = rt = runtime or Runtime(arena_bytes=None)
        with Checkpoint.open(model_dir) as ck:
            ck.validate()
            self.cfg = cfg = ck.config
            self.numerics = numerics or default_numerics(cfg)
            if self.numerics not in NUMERICS:
                raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got '{self.numerics}'")
            self.faithful = self.numerics != "exact"    # fast is faithful plus wo_a's act_quant
            self.fast = self.numerics == "fast"
            # (attention GEMMs in fp8, experts in fp4/fp8): read as stored, their inputs quantised
            self.fp8_attention, self.fp4_experts = released_formats(ck) if self.faithful else (False, False)
            self.w = load_weights(ck, self.dtype, rt.arena, rt.stream, raw=self.faithful).arrays
        self.max_len, self.max_batch, self.scores_budget = max_len, max_batch, scores_budget
        self.mqa = tensor_core_attention(cfg, self.dtype)
        self.rows, self.out_rows = step_shape(max_len, step_rows, max_batch)
        self.plan = build_plan(cfg, self.numerics, element_bytes=self.dtype.itemsize)
        self.kv = rt.arena.alloc(kv_bytes, "KV cache")
        self.allocator = SlabAllocator(kv_bytes, self.plan.class_page_bytes, slab_bytes)
        self.blocks = BlockManager(self.plan, self.allocator)
        self.tables = PageTables(rt.arena, self.plan, self.allocator, max_len, max_batch)
        # The compressor and the indexer run on streams of their own beside the query projections: at decode
        # sizes every kernel is latency-bound, so side by side they overlap.
        self.blas, self.side_blas, self.index_blas = (Blas(rt.arena, rt.device) for _ in range(BUILD_BLAS))
        self.side, self.index_side = Stream(), Stream()
        self.fork, self.q_ready, self.side_done, self.index_done = (Event(timing=False) for _ in range(4))
        self._rope_tables()
        self._experts()
        self._workspace()
        self.length = 0

    # --- one-time setup -------------------------------------------------------------------------
    def cache(self, kind: str, layer: int) -> PagedCache:
        return self.tables.cache(self.kv.ptr, kind, layer)

    def _rope_tables(self):
        self.inv_freq = []
        for i in range(self.cfg.num_layers):
            f = self.cfg.rope_inv_freq(i).astype(np.float32)
            buf = self.rt.arena.alloc(f.nbytes, "rope table")
            buf.copy_from_host(f)
            self.inv_freq.append(buf.ptr)

    def _experts(self):
        """Per layer: pointer tables of the routed experts' matrices and the shared expert's (None without one);
        in the released formats their scales too."""
        c, W = self.cfg, self.w
        parts = ("weight", "scale") if self.fp4_experts else ("weight",)
        routed, shared = (Fp4Experts, Fp8Expert) if self.fp4_experts else (ExpertWeights, ExpertWeights)
        self.expert_tables, self.shared_experts = [], []
        for i in range(c.num_layers):
            f = f"layers.{i}.ffn."
            tables = [pointer_table(self.rt.arena, [W[f"{f}experts.{e}.{m}.{part}"].ptr for e in range(c.n_experts)])
                      for part in parts for m in ("w1", "w3", "w2")]
            self.expert_tables.append(routed(*(t.ptr for t in tables)))
            self.shared_experts.append(shared(*(W[f"{f}shared_experts.{m}.{part}"].ptr for part in parts
                                                for m in ("w1", "w3", "w2"))) if c.n_shared else None)

    def _workspace(self):
        c, T = self.cfg, self.rows
        self.n_max = index_entries(c, self.max_len)
        self.score_rows = score_rows(T, self.n_max, self.scores_budget)
        self.moe_dims = moe_dims(c, T)
        fp8_wo_a = any(scale_name(f"layers.{i}.attn.wo_a.weight") in self.w for i in range(c.num_layers))
        self.inputs = StepInputs(T)
        self.ws = Workspace(self.rt.arena, workspace_sizes(
            c, self.dtype, rows=T, out_rows=self.out_rows, max_len=self.max_len, sm_count=self.rt.device.sm_count,
            numerics=self.numerics, fp8_attention=self.fp8_attention, fp4_experts=self.fp4_experts,
            fp8_wo_a=fp8_wo_a, scores_budget=self.scores_budget, arch=self.rt.device.arch))
        self.ws.ptr.update(self.inputs.pointers(self.ws["inputs"]))
        self.fp8_xn = "xn_q" in self.ws.ptr   # fp8 linear layers read xn: hc.pre quantises it (GpuModel._hc_pre)
        zeros = np.zeros(hc_k.pre_workspace_bytes(T, c.hc_mult, c.hidden_size), np.uint8)   # its counters start at 0
        self.ws.buffer.copy_from_host(zeros, self.rt.stream, offset=self.ws["hc_pre"] - self.ws.buffer.ptr)

    def _splits(self, i: int, T: int) -> int:
        return attention_splits(self.cfg, self.dtype, i, T, self.max_len, self.rt.device.sm_count)

    # --- one request (tests, `dsv4rt logits`) ---------------------------------------------------
    def forward(self, ids, last_only: bool = False) -> np.ndarray:
        """Logits [T, vocab] (float32) of the next tokens `ids` of the request in slot 0, or [1, vocab]
        of the last one."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if self.length + len(ids) > self.max_len:
            raise ValueError(f"{self.length + len(ids)} positions exceed this model's max_len {self.max_len}")
        out = []
        for entry, last in self._steps(ids, self.rows if last_only else self.out_rows):
            if not last_only or last:
                out.append(self.run([entry], every_row=not last_only))
            else:
                self.upload([entry], every_row=False)
                self.launch(len(entry.ids), 1, False)
        return np.concatenate(out) if out else np.zeros((0, self.cfg.vocab_size), np.float32)

    def _steps(self, ids: np.ndarray, size: int):
        """Slot 0's steps over `ids`, `size` tokens each, placed and their tables refreshed: (entry, whether
        last); the length advances when the caller asks for the next one."""
        for a in range(0, len(ids), size):
            chunk = ids[a:a + size]
            self.blocks.place(0, self.length + len(chunk))
            self.tables.refresh(0, self.blocks, 0, self.rt.stream)
            yield Entry(0, chunk, self.length), a + size >= len(ids)
            self.length += len(chunk)

    def reset(self):
        if self.length:
            self.blocks.release(0)
            self.tables.forget(0)
        self.length = 0

    def layer_alone(self, i: int, ids, streams: np.ndarray) -> np.ndarray:
        """Block i fed the given input streams [T, hc, D] (teacher forcing), from an empty cache and in
        steps like forward(); returns its output streams as float32."""
        self.reset()
        ids = np.asarray(ids, np.int64).reshape(-1)
        out = []
        for entry, _ in self._steps(ids, self.out_rows):
            T = self.upload([entry])
            x = np.ascontiguousarray(streams[entry.start:entry.start + T]).astype(self.dtype)
            self._hc_reset()
            self.ws.buffer.copy_from_host(x, self.rt.stream, offset=self.ws["X"] - self.ws.buffer.ptr)
            self.layer(i, T)
            self._hc_flush(T)
            out.append(self.read(self.streams, x.shape, self.dtype).astype(np.float32))
        self.reset()
        return np.concatenate(out)

    # --- a batched step -------------------------------------------------------------------------
    def run(self, entries: list[Entry], *, every_row: bool = False, sampling=None, pad_to: int = 0):
        """One step over the entries' tokens (their pages placed and tables refreshed by the caller).
        Returns the float32 logits of every row (every_row) or of each entry's last token; with
        `sampling` (SamplingArrays), the sampled token of each entry's last row instead. `pad_to` adds
        padding rows (req −1) so that a step has the shape of a captured decode graph."""
        T = self.upload(entries, pad_to, every_row, sampling)
        self.launch(T, self.inputs.n_out, sampling is not None)
        return self.outputs(len(entries), every_row, sampling is not None)

    def outputs(self, n: int, every_row: bool = False, sampled: bool = False) -> np.ndarray:
        """After a step: the tokens of the first n output rows, or the logits of those (or of every) row."""
        if sampled:
            return self.read("tokens", (n,), np.int32)
        rows = self.inputs.n_out if every_row else n
        return self.read("logits", (rows, self.cfg.vocab_size), F32)

    def upload(self, entries: list[Entry], pad_to: int = 0, every_row: bool = True, sampling=None) -> int:
        T = self.inputs.fill(entries, pad_to, every_row, sampling)
        if T > self.rows or self.inputs.n_out > self.out_rows:
            raise ValueError(f"a step of {T} tokens ({self.inputs.n_out} with logits) exceeds the workspace's "
                             f"{self.rows} ({self.out_rows})")
        self.ws.buffer.copy_from_host(self.inputs.host, self.rt.stream, offset=self.ws["inputs"] - self.ws.buffer.ptr)
        return T

    def launch(self, T: int, n_out: int, sample: bool):
        """The whole step's launches for T rows, the head on n_out gathered rows; no host synchronisation."""
        c, ws, st = self.cfg, self.ws, self.rt.stream
        self._hc_reset()
        hc_k.embed(self.rt.device, self.dtype, ws["X"], ws["ids"], self.w["embed.weight"].ptr, T, c.vocab_size,
                   c.hc_mult, c.hidden_size)(st)
        for i in range(c.num_layers):
            self.layer(i, T)
        self._hc_flush(T)
        self.head(T, n_out)
        if sample:
            sample_k.sample(self.rt.device, ws["tokens"], ws["logits"], n_out, c.vocab_size, ws["temperature"],
                            ws["top_k"], ws["top_p"], ws["seed"], ws["step"])(st)

    def read(self, name: str, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.rt.stream.synchronize()
        return self.ws.buffer.copy_to_host(out, offset=self.ws[name] - self.ws.buffer.ptr)

    def layer(self, i: int, T: int):
        """Block i on the streams in ws[self.streams]; its last hc_post may be left to the next _hc_pre (_hc_post)."""
        c, ws, st, dev, dt, W = self.cfg, self.ws, self.rt.stream, self.rt.device, self.dtype, self.w
        p = f"layers.{i}."
        self._hc_pre(p + "hc_attn", p + "attn_norm.weight", T, quantise=self.fp8_xn)
        a = p + "attn."
        hd, H, rd = c.head_dim, c.num_heads, c.rope_dim
        kind, ratio = c.kinds[i], c.ratios[i]
        compressed = selected = None
        joins = []
        if kind != SLIDING:
            main = "compressed_c4a" if kind == CSA else "compressed_c128a"
            state = "state_main_c4a" if kind == CSA else "state_c128a"
            compressed = self.cache(main, i)
            self.side.wait(st.record(self.fork))
            self._compress(a + "compressor.", compressed, self.cache(state, i), i, T, hd, ratio, kind == CSA,
                           ws["a"], ws["z"], self.side_blas, self.side, fp8_kv=self.faithful)
            joins.append(self.side.record(self.side_done))
        self._linear(a + "wq_a.weight", "xn", "qa", T, c.q_lora_rank, c.hidden_size, quantized=self.fp8_xn)(st)
        ops.rmsnorm(dev, dt, ws["qr"], ws["qa"], W[a + "q_norm.weight"].ptr, T, c.q_lora_rank, c.eps)(st)
        if kind == CSA:
            st.record(self.q_ready)       # before the indexer stream's wait for it is issued
            joins.append(self._indexer(i, T))
            selected = ws["selected"]
        self._linear(a + "wq_b.weight", "qr", "q", T, H * hd, c.q_lora_rank)(st)
        self._linear(a + "wkv.weight", "xn", "kv", T, hd, c.hidden_size, quantized=True)(st)   # xn's, as wq_a's
        window = self.cache("window", i)
        attn_k.qkv_norm_rope_insert(dev, dt, ws["q"], ws["kv"], W[a + "kv_norm.weight"].ptr, ws["pos"], ws["req"],
                                    self.inv_freq[i], window, rows=T, heads=H, head_dim=hd, rope_dim=rd, eps=c.eps,
                                    fp8_kv=self.faithful, step_kv=ws["kv_rows"])(st)
        for done in joins:
            st.wait(done)
        attention = attn_k.sparse_attention_mqa if self.mqa else attn_k.sparse_attention
        attention(dev, dt, ws["o"], ws["q"], ws["pos"], ws["req"], W[a + "attn_sink"].ptr, self.inv_freq[i], window,
                  compressed, selected, rows=T, heads=H, head_dim=hd, rope_dim=rd, window_size=c.window, ratio=ratio,
                  top_k=c.index_topk, splits=self._splits(i, T), workspace=ws["att"], fp8_kv=self.faithful,
                  step_kv=ws["kv_rows"])(st)
        self._output_projection(a + "wo_a.weight", T)(st)
        self._linear(a + "wo_b.weight", "t", "f", T, c.hidden_size, c.o_groups * c.o_lora_rank)(st)
        self._hc_post(T)
        quantised = self.fp4_experts and self.fp8_xn   # the released MoE reads hc.pre's act_quant(xn)
        self._hc_pre(p + "hc_ffn", p + "ffn_norm.weight", T, quantise=quantised)
        f = p + "ffn."
        hashed = c.hash_layers[i]
        dims = MoeDims(T, c.hidden_size, c.moe_inter, c.n_experts, c.n_active, self.moe_dims.shared_inter)
        (Fp4MoE if self.fp4_experts else MoE)(
            dev, self.blas, dt, dims, x=ws["xn"], y=ws["f"], gate=W[f + "gate.weight"].ptr,
            routed=self.expert_tables[i], shared=self.shared_experts[i], scaling=c.routed_scaling,
            limit=c.swiglu_limit, workspace=ws["moe"], bias=None if hashed else W[f + "gate.bias"].ptr,
            tid2eid=W[f + "gate.tid2eid"].ptr if hashed else None, ids=ws["ids"] if hashed else None,
            **({"x_quantized": (ws["xn_q"], ws["xn_s"])} if quantised else {}))(st)
        self._hc_post(T)

    def _linear(self, weight: str, x: str, y: str, m: int, n: int, k: int, blas: Blas | None = None, *,
                quantized_as: str | None = None, quantized: bool = False):
        """ws[y] = ws[x]·Wᵀ. A weight stored in fp8 takes the faithful fp8 linear layer, x's quantised form in
        ws[q_q], ws[q_s] with q = quantized_as or x (quantized: left there by an earlier launch on the stream);
        any other weight a GEMM in the build's type."""
        ws, W = self.ws, self.w
        scale = W.get(scale_name(weight))
        if scale is None:
            return linear(blas or self.blas, self.dtype, ws[x], W[weight].ptr, ws[y], m, n, k)
        q = quantized_as or x
        return linear_fp8(self.rt.device, self.dtype, ws[x], W[weight].ptr, scale.ptr, ws[y], m, n, k,
                          xq=ws[q + "_q"], xs=ws[q + "_s"], quantized=quantized)

    def _output_projection(self, weight: str, T: int):
        """ws[t] = wo_a applied per group to ws[o]. Stored in fp8, faithful (the reference quantises none of its
        inputs): decode batches stream it through the W8A16 GEMM, prefill batches of a bf16 build widen it in
        shared memory on sm_90a (gemm_w8a16) and elsewhere expand it into ws[wo_a] for cuBLAS. Fast: ws[o] quantised
        per group row by the act_quant kernel of every fp8 linear layer, then the grouped fp8 x fp8 GEMM. Not fused
        with the inverse RoPE: that stays in the epilogues of three attention kernels (CUDA-core, tensor-core, split
        merge), each of which would need a quantising twin."""
        c, ws, W, dt = self.cfg, self.ws, self.w, self.dtype
        G, n, k = c.o_groups, c.o_lora_rank, c.num_heads * c.head_dim // c.o_groups
        scale = W.get(scale_name(weight))
        if scale is None:
            return grouped_linear(self.blas, dt, ws["o"], W[weight].ptr, ws["t"], T, G, n, k)
        if self.fast:
            return linear_fp8(self.rt.device, dt, ws["o"], W[weight].ptr, scale.ptr, ws["t"], T, G * n, k,
                              xq=ws["o_q"], xs=ws["o_s"], group_n=n)
        if T <= SKINNY_ROWS:
            return fp8.skinny_gemm(self.rt.device, dt, ws["t"], ws["o"], 0, W[weight].ptr, scale.ptr, T, G * n, k,
                                   in_dtype=dt, group_n=n)
        if w8a16_fits(self.rt.device.arch, dt, n, k):
            return w8a16_gemm(self.rt.device, ws["t"], ws["o"], W[weight].ptr, scale.ptr, T, n, k, G)
        return LaunchSequence(fp8.dequantize(self.rt.device, dt, ws["wo_a"], W[weight].ptr, scale.ptr, G * n, k),
                              grouped_linear(self.blas, dt, ws["o"], ws["wo_a"], ws["t"], T, G, n, k))

    def _indexer(self, i: int, T: int) -> Event:
        """The indexer branch on its own stream, from the fork (xn ready) and q_ready (qr ready) events;
        returns the event attention waits for."""
        c, ws, side, dt, W, blas = self.cfg, self.ws, self.index_side, self.dtype, self.w, self.index_blas
        side.wait(self.fork)
        x = f"layers.{i}.attn.indexer."
        nI, dI = c.index_n_heads, c.index_head_dim
        self._compress(x + "compressor.", self.cache("indexer", i), self.cache("state_indexer", i), i, T, dI,
                       c.csa_ratio, True, ws["ia"], ws["iz"], blas, side, fp4_keys=self.faithful)
        linear(blas, dt, ws["xn"], W[x + "weights_proj.weight"].ptr, ws["iw"], T, nI, c.hidden_size, F32,
               alpha=dI ** -0.5 * nI ** -0.5)(side)
        side.wait(self.q_ready)
        self._linear(x + "wq_b.weight", "qr", "iq", T, nI * dI, c.q_lora_rank, blas, quantized_as="iqr")(side)
        keys, k = self.cache("indexer", i), c.index_topk
        for a in range(0, T, self.score_rows):   # row chunks through one scores buffer (memory.score_rows)
            comp_k.indexer_select(self.rt.device, dt, ws["selected"] + 4 * k * a, ws["scores"],
                                  ws["iq"] + nI * dI * dt.itemsize * a, ws["iw"] + 4 * nI * a, keys, ws["pos"] + 4 * a,
                                  ws["req"] + 4 * a, rows=min(self.score_rows, T - a), heads=nI, head_dim=dI, topk=k,
                                  n_max=self.n_max, ratio=c.csa_ratio, inv_freq=self.inv_freq[i], rope_dim=c.rope_dim,
                                  fp4_keys=self.faithful)(side)
        return side.record(self.index_done)

    def _compress(self, prefix, out, state, i, T, width, ratio, overlap, a, z, blas, stream, **stored):
        """The compressor's two projections and fusion 1; `stored`: the cache's format (fp8_kv, fp4_keys)."""
        c, ws, W = self.cfg, self.ws, self.w
        n = (2 if overlap else 1) * width
        linear(blas, self.dtype, ws["xn"], W[prefix + "wkv.weight"].ptr, a, T, n, c.hidden_size, F32)(stream)
        linear(blas, self.dtype, ws["xn"], W[prefix + "wgate.weight"].ptr, z, T, n, c.hidden_size, F32)(stream)
        comp_k.compress_pool(self.rt.device, self.dtype, out, state, a, z, W[prefix + "ape"].ptr,
                             W[prefix + "norm.weight"].ptr, self.inv_freq[i], ws["pos"], ws["req"], rows=T,
                             width=width, ratio=ratio, overlap=overlap, rope_dim=c.rope_dim, eps=c.eps,
                             **stored)(stream)

    # The streams live in ws[self.streams] and the last hc_pre's post and comb in the pair beside them (_mix). On
    # decode batches an hc_post is left pending and the next hc_pre applies it in its own launch (one launch less
    # per sublayer); that writes the new streams to the other buffer and its post and comb to the other pair, since
    # its blocks still read the old ones.
    def _hc_reset(self):
        self.streams, self.post_pending = "X", False

    def _mix(self) -> tuple[int, int]:
        return tuple(self.ws[m + ("" if self.streams == "X" else "_b")] for m in ("post", "comb"))

    def _hc_pre(self, hc: str, norm: str, T: int, quantise: bool):
        """The next sublayer's input: ws[u] and its norm ws[xn]; with quantise also act_quant(xn) into ws[xn_q],
        ws[xn_s]."""
        c, ws, dev, W = self.cfg, self.ws, self.rt.device, self.w
        fused = None
        if self.post_pending:
            fused = (ws[self.streams], ws["f"], *self._mix())
            self.streams = "X_b" if self.streams == "X" else "X"
            self.post_pending = False
        hc_k.pre(dev, self.dtype, ws["u"], *self._mix(), ws[self.streams], W[hc + "_fn"].ptr,
                 W[hc + "_base"].ptr, W[hc + "_scale"].ptr, T, c.hc_mult, c.hidden_size, c.eps, c.hc_eps, c.hc_iters,
                 xn=ws["xn"], norm=W[norm].ptr, norm_eps=c.eps, workspace=ws["hc_pre"], fused_post=fused,
                 xq=ws["xn_q"] if quantise else 0, xs=ws["xn_s"] if quantise else 0)(
            self.rt.stream)

    def _hc_post(self, T: int):
        self.post_pending = True
        if T > hc_k.decode_tokens(self.rt.device.sm_count):
            self._hc_flush(T)

    def _hc_flush(self, T: int):
        """The pending hc_post, where no hc_pre follows to apply it."""
        if not self.post_pending:
            return
        c, ws, x = self.cfg, self.ws, self.ws[self.streams]
        hc_k.post(self.rt.device, self.dtype, x, x, ws["f"], *self._mix(), T, c.hc_mult,
                  c.hidden_size)(self.rt.stream)
        self.post_pending = False

    def head(self, T: int, n_out: int):
        c, ws, dev, W, st = self.cfg, self.ws, self.rt.device, self.w, self.rt.stream
        hc_k.head(dev, self.dtype, ws["u"], ws[self.streams], W["hc_head_fn"].ptr, W["hc_head_base"].ptr,
                  W["hc_head_scale"].ptr, T, c.hc_mult, c.hidden_size, c.eps, c.hc_eps)(st)
        # the rows that need logits, gathered (the embedding kernel over a table of T rows)
        hc_k.embed(dev, self.dtype, ws["xn"], ws["out_rows"], ws["u"], n_out, T, 1, c.hidden_size)(st)
        ops.rmsnorm(dev, self.dtype, ws["y"], ws["xn"], W["norm.weight"].ptr, n_out, c.hidden_size, c.eps)(st)
        linear(self.blas, self.dtype, ws["y"], W["head.weight"].ptr, ws["logits"], n_out, c.vocab_size,
               c.hidden_size, F32)(st)
