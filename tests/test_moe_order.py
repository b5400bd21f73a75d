"""The routing weight scales the SwiGLU output before w2 and before w2's act_quant (docs/model.md#moe), the
official code's order: one expert call against a float64 evaluation of w2(act_quant(w·h)), and the whole faithful
reference on a well-conditioned released-format checkpoint (tests/conditioned.py) against a float64 evaluation
with the MoE written out from the formulas."""
import numpy as np
import pytest

from conftest import rel_rows
from conditioned import T, conditioned_ids, make_conditioned
from dsv4rt.loader import Checkpoint
from dsv4rt.reference import Model, Numerics, checkpoint_weights, load_model
from dsv4rt.reference.quant import act_quant


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_conditioned(tmp_path_factory.mktemp("conditioned") / "model")


@pytest.fixture(scope="module")
def ref(path):
    return load_model(path, "faithful")


def swiglu64(expert, x, weight):
    """weight · silu(min(w1 x, L)) · clamp(w3 x, −L, L) in float64, x act_quant-ed as w1 and w3 are fp4."""
    xq, L = act_quant(x.astype(np.float64)), expert.limit
    g = np.minimum(xq @ expert.w1.w.astype(np.float64).T, L)
    u = np.clip(xq @ expert.w3.w.astype(np.float64).T, -L, L)
    return weight[:, None] * (g / (1 + np.exp(-g))) * u


def expert64(expert, x, weight):
    return act_quant(swiglu64(expert, x, weight)) @ expert.w2.w.astype(np.float64).T


def test_one_expert_weights_its_swiglu_output_before_w2(ref):
    rng = np.random.default_rng(1)
    expert = ref.layers[1].moe.experts[0]
    x = rng.standard_normal((64, ref.cfg.hidden_size)).astype(np.float32)
    w = rng.uniform(0.2, 1.5, 64).astype(np.float32)
    got, want = expert(x, w), expert64(expert, x, w)
    assert rel_rows(got, want).max() < 1e-6
    after = w[:, None] * (act_quant(swiglu64(expert, x, np.ones(64))) @ expert.w2.w.astype(np.float64).T)
    assert np.median(rel_rows(after, want)) > 1e-3   # the other order is not within rounding noise of this one


class FormulaMoE:
    """docs/model.md#moe written out in float64 for layers where every expert is active."""

    def __init__(self, moe):
        assert moe.n_active == len(moe.experts) and moe.tid2eid is None
        self.moe = moe

    def __call__(self, x, ids):
        m = self.moe
        s = np.sqrt(np.logaddexp(0, x @ m.gate.T))
        w = s / s.sum(axis=1, keepdims=True) * m.scaling
        y = expert64(m.shared, x, np.ones(len(x)))
        for e, expert in enumerate(m.experts):
            y = y + expert64(expert, x, w[:, e])
        return y


@pytest.fixture(scope="module")
def formula(path):
    with Checkpoint.open(path) as ck:
        weights = checkpoint_weights(ck)
        quantized = frozenset(n for n in weights if ck.is_quantized(n))
        cfg = ck.config
    wide = {n: w.astype(np.float64) if w.dtype == np.float32 else w for n, w in weights.items()}
    model = Model(cfg, wide, Numerics.named("faithful"), quantized)
    for layer in model.layers:
        layer.moe = FormulaMoE(layer.moe)
    return model


def one_by_one(model, ids):
    st = model.new_state()
    return np.concatenate([model.forward(st, ids[t:t + 1]) for t in range(len(ids))])


@pytest.mark.parametrize("run", ["full", "token_by_token"])
def test_faithful_reference_equals_the_formulas_in_float64(ref, formula, run):
    ids = conditioned_ids()
    if run == "full":
        got, want = ref.logits_chunked(ids), formula.logits_chunked(ids)
    else:
        got, want = one_by_one(ref, ids), one_by_one(formula, ids)
    assert want.dtype == np.float64 and len(want) == T
    err = rel_rows(got, want)
    assert np.mean(err <= 1e-5) >= 0.99, (np.median(err), err.max())


def test_exact_numerics_are_untouched_by_the_order(path):
    """Without quantisation the two orders agree: exact logits of the same checkpoint stay within float32 noise of
    the faithful formula model's exact twin."""
    exact = load_model(path, "exact")
    ids = conditioned_ids()[:64]
    with Checkpoint.open(path) as ck:
        weights = {n: w.astype(np.float64) if w.dtype == np.float32 else w for n, w in checkpoint_weights(ck).items()}
        cfg = ck.config
    wide = Model(cfg, weights)
    assert rel_rows(exact.logits_chunked(ids), wide.logits_chunked(ids)).max() < 1e-5
