"""The numpy reference run rank by rank on a layout's shards, the collectives simulated (docs/parallel.md#a-step).

Each rank is a reference Model built from its shard alone (its heads, groups, experts and vocabulary rows); this
runner only moves rows between ranks around the reference's own pieces: hyper-connections, Attention's
grouped_output and wo_b, MoE's route and add_routed, the final norm.

Two ways to place a step's tokens, both exact rearrangements of the unsharded forward:
* split_tokens (prefill): between attentions each rank owns a contiguous share of the tokens. Attention inputs are
  all-gathered, attention outputs reduce-scattered back to their owners, and routed tokens go to the ranks holding
  their experts and back by all-to-all (dispatch and combine).
* replicated (decode): every rank keeps every token; attention and MoE outputs are all-reduced, each rank running
  its own experts on the tokens routed to them. Fewer, smaller collectives: what latency-bound steps want.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..reference import Model, Numerics, SequenceState
from ..reference.hc import HyperConnection
from ..reference.ops import rmsnorm
from . import collectives as cc
from .layout import Layout, LayoutError

ACT_BLOCK = 128   # act_quant's block (docs/numerics.md#act-quant)


class ShardedReference:
    def __init__(self, cfg, weights: dict, n: int, numerics: Numerics = Numerics(), quantized=frozenset(),
                 split_tokens: bool = True):
        """weights and quantized as for reference.Model: every tensor of the checkpoint, dequantised."""
        self.cfg, self.layout, self.split_tokens = cfg, Layout(cfg, n), split_tokens
        width = self.layout.wo_b_columns(0)[1]
        if numerics.act_quant and any(n.endswith("attn.wo_b.weight") for n in quantized) and width % ACT_BLOCK:
            raise LayoutError(f"faithful numerics quantise wo_b's input in blocks of {ACT_BLOCK}: each of {n} GPUs "
                              f"would hold {width} of its columns, not a whole number of blocks")
        k = self.layout.ranks_per_group
        part = cfg.num_heads * cfg.head_dim // cfg.o_groups // k
        if numerics.wo_a_quant and any(n.endswith("attn.wo_a.weight") for n in quantized) and part % ACT_BLOCK \
                and k > 1:
            raise LayoutError(f"fast numerics quantise wo_a's input in blocks of {ACT_BLOCK} per group: each of the "
                              f"{k} GPUs sharing a group would hold {part} of its columns, not a whole number of blocks")
        self.ranks = [self._rank_model(weights, numerics, quantized, r) for r in range(n)]

    def _rank_model(self, weights, numerics, quantized, r) -> Model:
        L, c = self.layout, self.cfg
        v0, v1 = L.vocab(r)
        local = dataclasses.replace(c, num_heads=L.heads_per_rank, o_groups=max(c.o_groups // L.n, 1),
                                    n_experts=c.n_experts // L.n, vocab_size=v1 - v0)
        shard = {L.local_name(name, r): weights[name][tuple(slice(a, b) for a, b in idx)]
                 for name, idx in L.shards(r).items()}
        return Model(local, shard, numerics, frozenset(L.local_name(n, r) for n in quantized))

    def new_state(self) -> list[SequenceState]:
        return [m.new_state() for m in self.ranks]

    def forward(self, states: list[SequenceState], ids) -> np.ndarray:
        """Logits [T, vocab] of the chunk `ids`, continuing every rank's state (each advances by T)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        L, T = self.layout, len(ids)
        own = self._owners(T)
        pos = states[0].pos + np.arange(T)
        rows = []
        for r, m in enumerate(self.ranks):   # each rank looks up the ids of its vocabulary rows, zeros elsewhere
            v0, v1 = L.vocab(r)
            mine = (ids >= v0) & (ids < v1)
            rows.append(np.where(mine[:, None], m.embed[np.where(mine, ids - v0, 0)], np.float32(0)))
        X = [np.repeat(x[:, None, :], self.cfg.hc_mult, axis=1) for x in self._to_owners(rows, own)]
        for i in range(self.cfg.num_layers):
            X = self._layer(i, X, [s.layers[i] for s in states], ids, pos, own)
        y = self._gather([m.final_hidden(x) for m, x in zip(self.ranks, X)])
        for s in states:
            s.pos += T
        return cc.all_gather([yr @ m.head.T for yr, m in zip(y, self.ranks)], axis=1)[0]

    def layer(self, i: int, X: np.ndarray, states: list[SequenceState], ids) -> np.ndarray:
        """One block on the streams X [T, hc, D], like Model.layer: the states' caches grow, their positions stay."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        own = self._owners(len(ids))
        out = self._layer(i, [X[a:b] for a, b in own], [s.layers[i] for s in states], ids,
                          states[0].pos + np.arange(len(ids)), own)
        return np.concatenate(out) if self.split_tokens else out[0]

    logits_chunked = Model.logits_chunked   # new_state and forward take and give this runner's list of states

    def _layer(self, i, X, states, ids, pos, own):
        eps, layers = self.cfg.eps, [m.layers[i] for m in self.ranks]
        pre = [lay.attn_hc.pre(x) for lay, x in zip(layers, X)]
        xs = self._gather([rmsnorm(u, lay.attn_norm, eps) for lay, (u, _, _) in zip(layers, pre)])
        t = [lay.attn.grouped_output(st, x, pos) for lay, st, x in zip(layers, states, xs)]
        k = self.layout.ranks_per_group
        if k > 1:   # the ranks of one group hold parts of its sum; each keeps the wo_b columns it holds
            width = t[0].shape[1] // k
            t = [part for g in range(0, len(t), k)
                 for part in cc.reduce_scatter(t[g:g + k], [(j * width, (j + 1) * width) for j in range(k)], axis=1)]
        a = self._to_owners([lay.attn.wo_b(tr) for lay, tr in zip(layers, t)], own)
        X = [HyperConnection.post(x, ar, post, comb) for x, ar, (_, post, comb) in zip(X, a, pre)]
        pre = [lay.ffn_hc.pre(x) for lay, x in zip(layers, X)]
        xs = [rmsnorm(u, lay.ffn_norm, eps) for lay, (u, _, _) in zip(layers, pre)]
        f = self._moe(layers, xs, [ids[a:b] for a, b in own])
        return [HyperConnection.post(x, fr, post, comb) for x, fr, (_, post, comb) in zip(X, f, pre)]

    def _moe(self, layers, xs, ids):
        """Each rank's MoE output for its tokens: the shared expert where the token lives, routed experts where
        they are held."""
        n, L = self.layout.n, self.layout
        routes = [lay.moe.route(x, i) for lay, x, i in zip(layers, xs, ids)]
        out = [lay.moe.shared(x) if lay.moe.shared is not None else np.zeros_like(x) for lay, x in zip(layers, xs)]
        if not self.split_tokens:
            partial = [lay.moe.add_routed(np.zeros_like(x), x, _local(idx, *L.experts(r)), w)
                       for r, (lay, x, (idx, w)) in enumerate(zip(layers, xs, routes))]
            routed = cc.all_reduce(partial)
            return [o + y for o, y in zip(out, routed)]
        send = []
        for x, (idx, w) in zip(xs, routes):
            to = []
            for d in range(n):
                local = _local(idx, *L.experts(d))
                rows = np.nonzero((local >= 0).any(axis=1))[0]
                to.append((rows, x[rows], local[rows], w[rows]))
            send.append(to)
        back = []
        for d, received in enumerate(cc.all_to_all([[msg[1:] for msg in to] for to in send])):
            x = np.concatenate([m[0] for m in received])
            y = layers[d].moe.add_routed(np.zeros_like(x), x, np.concatenate([m[1] for m in received]),
                                         np.concatenate([m[2] for m in received]))
            back.append(np.split(y, np.cumsum([len(m[0]) for m in received])[:-1]))
        for s, returned in enumerate(cc.all_to_all(back)):
            for d, y in enumerate(returned):
                np.add.at(out[s], send[s][d][0], y)
        return out

    def _owners(self, T: int) -> list[tuple[int, int]]:
        return [self.layout.tokens(T, r) if self.split_tokens else (0, T) for r in range(self.layout.n)]

    def _to_owners(self, parts, own):
        return cc.reduce_scatter(parts, own) if self.split_tokens else cc.all_reduce(parts)

    def _gather(self, parts):
        return cc.all_gather(parts) if self.split_tokens else parts


def _local(idx: np.ndarray, first: int, stop: int) -> np.ndarray:
    """Routing indices as a rank holding experts [first, stop) sees them: its own list's index, -1 elsewhere."""
    return np.where((idx >= first) & (idx < stop), idx - first, -1)
