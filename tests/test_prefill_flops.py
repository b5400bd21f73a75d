"""prefill_flops against a count of the numpy reference's own products during real forwards; the Flash and
flash-slice figures; `dsv4rt bench prefill`'s table and its --tokens check (CPU)."""
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import TINY_A
from dsv4rt import benchmarks
from dsv4rt.cli import main
from dsv4rt.config import ModelConfig, from_dict
from dsv4rt.loader import Checkpoint
from dsv4rt.loader.names import expected_shapes
from dsv4rt.model.roofline import prefill_flops
from dsv4rt.presets import PRESETS
from dsv4rt.reference import Model, checkpoint_weights
from dsv4rt.reference.attention import Attention, Indexer
from dsv4rt.tiny import write_random_checkpoint

FLASH = ModelConfig.load(Path(__file__).parent / "fixtures" / "configs" / "deepseek-v4-flash.json")


class Counted(np.ndarray):
    """A weight matrix: every matmul it takes part in adds 2·m·n·k to `flops`; results are plain arrays."""
    flops = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, Counted) else x for x in inputs]
        out = getattr(ufunc, method)(*plain, **kwargs)
        if ufunc is np.matmul:
            Counted.flops += 2 * out.size * plain[0].shape[-1]
        return out


@pytest.fixture
def counting(monkeypatch):
    """Attention: QK and PV over the keys each query's mask lets in; indexer: each head of each query against
    the visible entries (the reference scores all entries, then masks; a causal kernel does not)."""
    attend, select = Attention._attend, Indexer.select

    def counted_attend(self, q, keys, mask):
        Counted.flops += 2 * 2 * q.shape[1] * q.shape[2] * int(mask.sum())
        return attend(self, q, keys, mask)

    def counted_select(self, st, x, qr, pos, rope, ratio):
        visible = np.arange(st.count)[None, :] < ((pos + 1) // ratio)[:, None]
        Counted.flops += 2 * self.wq_b.shape[0] * int(visible.sum())   # wq_b rows: heads × index_head_dim
        return select(self, st, x, qr, pos, rope, ratio)

    monkeypatch.setattr(Attention, "_attend", counted_attend)
    monkeypatch.setattr(Indexer, "select", counted_select)
    Counted.flops = 0


def counted_model(model_dir) -> Model:
    with Checkpoint.open(model_dir) as ck:
        W, cfg = checkpoint_weights(ck), ck.config
    plain = ("embed.weight", "ape", "tid2eid")      # looked up by row, never multiplied
    return Model(cfg, {n: w.view(Counted) if w.ndim == 2 and not n.endswith(plain) else w for n, w in W.items()})


def brute_force(model: Model, T: int, chunks: list[int]) -> int:
    ids = np.random.default_rng(T).integers(0, model.cfg.vocab_size, T)
    Counted.flops = 0
    logits = model.logits_chunked(ids, chunks)
    assert type(logits) is np.ndarray and np.isfinite(logits).all()
    return Counted.flops


# tiny-a: every layer kind, window 16, ratios 4 and 16, top-8, so that at 150 tokens the window, the top-k and
# both ratios all cap; the variant has unequal wo_a and wo_b sizes, 4 groups, 3 streams, no shared expert
VARIANT = dict(json.loads((TINY_A / "config.json").read_text()), vocab_size=300, q_lora_rank=40, o_groups=4,
               o_lora_rank=24, sliding_window=8, index_topk=5, num_experts_per_tok=3, n_shared_experts=0, hc_mult=3)


@pytest.mark.parametrize("variant", [False, True], ids=["tiny-a", "variant"])
def test_count_equals_the_reference_products(counting, tmp_path, variant):
    model = counted_model(write_random_checkpoint(tmp_path / "m", VARIANT, tokenizer=False) if variant else TINY_A)
    cfg, T = model.cfg, 150
    expected = prefill_flops(cfg, T, every_logit=True)   # the reference computes every position's logits
    assert brute_force(model, T, [T]) == expected
    assert brute_force(model, T, [40, 1, 56, 53]) == expected                # chunks change no product
    assert brute_force(model, 1, [1]) == prefill_flops(cfg, 1)
    assert prefill_flops(cfg, T) == expected - 2 * (T - 1) * cfg.vocab_size * cfg.hidden_size


def active_weights(cfg) -> int:
    """The loader's matrices that a token multiplies by, routed experts as the share a token picks."""
    total = 0
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 2 and not name.endswith(("embed.weight", "ape", "tid2eid")):
            total += shape[0] * shape[1] * (cfg.n_active if ".experts." in name else cfg.n_experts) // cfg.n_experts
    return total


def test_flash_figures():
    """Flash (43 layers, 12.7 B active weights a token besides the head) costs 5.4 times the issue's figures:
    those (5.2, 5.8, 15 GFLOP a token) are flash-slice's, the 8-layer model the issue measured."""
    assert {T: prefill_flops(FLASH, T) for T in (8192, 65536, 1048576)} == {
        8192: 228238330691584, 65536: 2036442647756800, 1048576: 87493041864048640}
    assert prefill_flops(FLASH, 1) == 2 * (active_weights(FLASH) + FLASH.num_layers * 2 * 64 * 512)   # one key a layer
    per_token = [prefill_flops(FLASH, T) / T / 1e9 for T in (8192, 65536, 1048576)]
    assert np.allclose(per_token, [27.861, 31.074, 83.440], atol=1e-3)
    fs = from_dict(PRESETS["flash-slice"])
    per_token = [prefill_flops(fs, T) / T / 1e9 for T in (8192, 65536, 1048576)]
    assert np.allclose(per_token, [5.171, 5.759, 15.326], atol=1e-3)
    assert np.allclose(per_token, [5.2, 5.8, 15], rtol=0.025)
    assert active_weights(fs) - fs.vocab_size * fs.hidden_size == pytest.approx(2.35e9, rel=0.01)


def test_prefill_table(monkeypatch, tmp_path):
    fs = from_dict(PRESETS["flash-slice"])
    row = benchmarks.prefill_row(fs, 8192, 0.5, 790.0, "chunks of 127")
    assert row == dict(tokens=8192, seconds=0.5, tokens_per_s=16384.0, gflop_per_token=42357179285504 / 8192e9,
                       tflops=42357179285504 / 0.5e12, fraction=42357179285504 / 0.5e12 / 790, note="chunks of 127")
    monkeypatch.setattr(benchmarks, "prefill", lambda model_dir, lengths, ceiling, reps: [
        benchmarks.prefill_row(fs, T, T / 4000, ceiling, "chunks of 127") for T in lengths])
    out = tmp_path / "p.json"
    r = CliRunner().invoke(main, ["bench", "prefill", "--model", str(tmp_path), "--tokens", "8192,1048576",
                                  "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "| tokens | seconds | tokens_per_s | gflop_per_token | tflops | fraction | note |"
    assert lines[2] == "| 8192 | 2.048 | 4000.000 | 5.171 | 20.682 | 0.026 | chunks of 127 |"
    assert lines[3] == "| 1048576 | 262.144 | 4000.000 | 15.326 | 61.303 | 0.078 | chunks of 127 |"
    saved = json.loads(out.read_text())
    assert saved["bf16_tflops"] == 790.0 and [x["gflop_per_token"] for x in saved["rows"]] == pytest.approx(
        [5.1705541, 15.3256385])


@pytest.mark.parametrize("tokens, message", [
    ("1048577", "Invalid value for '--tokens': 1048577 is above 1048576 tokens, the longest prompt the models take"),
    ("8192,2e6", "Invalid value for '--tokens': 2000000 is above 1048576 tokens, the longest prompt the models take"),
    ("0", "Invalid value for '--tokens': '0' is not a comma-separated list of positive whole numbers"),
])
def test_tokens_option_is_checked(tmp_path, tokens, message):
    r = CliRunner().invoke(main, ["bench", "prefill", "--model", str(tmp_path / "none"), "--tokens", tokens])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: {message}"], r.stderr
