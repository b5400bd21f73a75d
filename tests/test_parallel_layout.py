"""The parallel layout (docs/parallel.md): each rank's slice of every tensor, in the released formats."""
import json

import numpy as np
import pytest

from conftest import FIXTURES, TINY_A
from dsv4rt.config import ModelConfig, from_dict
from dsv4rt.loader import expected_shapes, quant_fp4, quant_fp8
from dsv4rt.loader.formats import dequant_fp4, dequant_fp8
from dsv4rt.parallel import Layout, LayoutError, stored_bytes, stored_slices
from dsv4rt.tiny import released_format

CONFIGS = FIXTURES / "configs"
GIB = 1 << 30


def tiny_a(**change) -> ModelConfig:
    return from_dict(json.loads((TINY_A / "config.json").read_text()) | change)


def flash() -> ModelConfig:
    return ModelConfig.load(CONFIGS / "deepseek-v4-flash.json")


def volume(idx) -> int:
    return int(np.prod([b - a for a, b in idx]))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_tensor_is_split_exactly_or_held_whole_by_every_rank(n):
    cfg = tiny_a()
    layout = Layout(cfg, n)
    shards = [layout.shards(r) for r in range(n)]
    split = {"embed.weight", "head.weight"}
    for name, shape in expected_shapes(cfg).items():
        held = [s[name] for s in shards if name in s]
        whole = tuple((0, s) for s in shape)
        if ".experts." in name:
            assert held == [whole]
        elif name in split or name.endswith(("attn.wq_b.weight", "attn_sink", "attn.wo_a.weight", "attn.wo_b.weight")):
            cover = np.zeros(shape, np.int32)
            for idx in held:
                cover[tuple(slice(a, b) for a, b in idx)] += 1
            assert len(held) == n and (cover == 1).all(), name
        else:
            assert held == [whole] * n, name


def test_heads_groups_and_columns_line_up():
    c = tiny_a()   # 4 heads of 32, 2 groups of o_lora 32
    two, four = Layout(c, 2), Layout(c, 4)
    assert [two.heads(r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [two.wo_a(r) for r in range(2)] == [((0, 32), (0, 64)), ((32, 64), (0, 64))]
    # four GPUs, two groups: a group's two ranks hold its wo_a rows, each the columns of its own head
    assert four.ranks_per_group == 2
    assert [four.wo_a(r) for r in range(4)] == [((0, 32), (0, 32)), ((0, 32), (32, 64)),
                                                 ((32, 64), (0, 32)), ((32, 64), (32, 64))]
    assert [four.wo_b_columns(r) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert [four.experts(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [four.vocab(r) for r in range(4)] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert [four.tokens(3, r) for r in range(4)] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert four.local_name("layers.3.ffn.experts.5.w2.weight", 2) == "layers.3.ffn.experts.1.w2.weight"
    assert four.local_name("layers.3.ffn.shared_experts.w2.weight", 2) == "layers.3.ffn.shared_experts.w2.weight"


@pytest.mark.parametrize("change, n, message", [
    ({}, 3, "cannot split 4 attention heads over 3 GPUs: 3 must divide 4"),
    ({"n_routed_experts": 6}, 4, "cannot split 6 routed experts over 4 GPUs: 4 must divide 6"),
    ({"num_attention_heads": 6, "o_groups": 3}, 2, "cannot split 3 output groups of rank 32 over 2 GPUs"),
    ({"o_lora_rank": 33}, 4, "cannot split 2 output groups of rank 33 over 4 GPUs"),
    ({}, 0, "the GPU count must be at least 1, got 0"),
])
def test_indivisible_layouts_are_refused(change, n, message):
    with pytest.raises(LayoutError, match=message):
        Layout(tiny_a(**change), n)


def aligned() -> ModelConfig:
    """Small, but every split falls on 128-wide fp8 blocks and 32-wide fp4 blocks as in the real models."""
    return tiny_a(hidden_size=256, head_dim=128, q_lora_rank=128, o_lora_rank=256, moe_intermediate_size=64,
                  num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])


@pytest.mark.parametrize("n", [2, 4])
def test_quantised_shards_decode_to_the_slices_of_the_whole(n):
    cfg, rng = aligned(), np.random.default_rng(0)
    layout = Layout(cfg, n)
    for name, shape in expected_shapes(cfg).items():
        fmt = released_format(name)
        if fmt not in ("fp8", "fp4"):
            continue
        quant, dequant = (quant_fp8, dequant_fp8) if fmt == "fp8" else (quant_fp4, dequant_fp4)
        w, scale = quant(rng.standard_normal(shape).astype(np.float32))
        stored = {name: w, name.removesuffix(".weight") + ".scale": scale}
        whole = dequant(w, scale)
        for r in range(n):
            idx = layout.index(name, shape, r)
            if idx is None:
                continue
            pieces = stored_slices(name, fmt, shape, idx)
            part = dequant(*(stored[k][v] for k, v in pieces.items()))
            assert np.array_equal(part, whole[tuple(slice(a, b) for a, b in idx)]), (name, r)
            assert stored_bytes(fmt, part.shape) == sum(stored[k][v].nbytes for k, v in pieces.items())


def test_a_slice_across_scale_blocks_is_refused():
    with pytest.raises(LayoutError, match=r"layers.0.attn.wq_b.weight: rows 0:64 do not fall on the 128-wide "
                                          r"blocks of its fp8 scales"):
        stored_slices("layers.0.attn.wq_b.weight", "fp8", (256, 128), ((0, 64), (0, 128)))
    with pytest.raises(LayoutError, match="columns 16:64 do not fall on the 32-wide blocks of its fp4 scales"):
        stored_slices("layers.0.ffn.experts.0.w1.weight", "fp4", (8, 64), ((0, 8), (16, 64)))
    # a slice may end where the tensor ends, inside a block
    assert stored_slices("x.weight", "fp8", (200, 128), ((128, 200), (0, 128)))["x.scale"] == (slice(1, 2), slice(0, 1))


def fp8(rows, cols):
    return rows * cols + -(-rows // 128) * -(-cols // 128)


def test_flash_weighs_145_gib_as_released_and_splits_evenly():
    """docs/parallel.md#memory: fp8 attention and shared experts, fp4 routed experts with e8m0 scales per 32."""
    c = flash()
    D, H, hd, ql, G, ol, E, F, V = 4096, 64, 512, 1024, 8, 1024, 256, 2048, 129280
    expert = F * D // 2 + F * D // 32
    routed = 43 * E * 3 * expert
    assert routed / GIB == pytest.approx(137.1, abs=0.05)   # the 277 B routed weights in 137 GiB
    split_attn = 43 * (fp8(H * hd, ql) + fp8(G * ol, H * hd // G) + fp8(D, G * ol) + 4 * H)
    split = routed + split_attn + 2 * (2 * V * D)
    attn = fp8(ql, D) + 2 * ql + fp8(hd, D) + 2 * hd
    hc = 2 * (4 * 24 * 4 * D + 4 * 24 + 12)
    comp = {4: 2 * (2 * 2 * hd * D) + 4 * 4 * 2 * hd + 2 * hd, 128: 2 * (2 * hd * D) + 4 * 128 * hd + 2 * hd}
    indexer = fp8(64 * 128, ql) + 2 * 64 * D + 2 * (2 * 2 * 128 * D) + 4 * 4 * 256 + 2 * 128
    ffn = 2 * E * D + 3 * fp8(F, D)
    replicated = 2 * D + 4 * 4 * D * 4 + 4 * 4 + 4 + sum(
        attn + 2 * 2 * D + hc + ffn + (4 * V * 6 if c.hash_layers[i] else 4 * E)
        + (comp[r] if r else 0) + (indexer if r == 4 else 0) for i, r in enumerate(c.ratios))
    assert Layout(c, 1).bytes_per_rank() == [split + replicated]
    assert (split + replicated) / GIB == pytest.approx(145.29, abs=0.005)
    for n in (2, 4, 8):
        assert Layout(c, n).bytes_per_rank() == [split // n + replicated] * n
