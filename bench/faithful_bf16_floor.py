"""How close can any bf16 build come to the faithful float32 reference, layer by layer (issue 6)?

Emulates bf16 storage inside the numpy reference by monkeypatching it, then repeats
test_gpu_faithful.py::test_bf16_layers_with_teacher_forcing against the plain reference:
  aq-in  only the inputs of act_quant (fp8/fp4 GEMM inputs) rounded to bf16, everything else float32
  q-in   the inputs of all three faithful roundings rounded to bf16: act_quant, the fp8 kv cache and the
         indexer's Hadamard + fp4 (tiny-a has only the last two)
  full   also every Linear output, every RMSNorm output, the rotated q/kv, the attention output and the
         block outputs rounded to bf16 (what a bf16 build stores between kernels)
  fused  like full, but RMSNorm outputs and act_quant inputs stay float32 (a build that fuses norm and
         quantisation and quantises GEMM outputs in the epilogue before the bf16 store)
  noise  control: the reference with float32 weights times 1 + 1e-6·N(0,1) (float32 reordering noise)
Run: python bench/faithful_bf16_floor.py"""
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv4rt.reference import attention, compressor, model, moe, ops, quant, load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import TINY_A, rel_rows  # noqa: E402
from test_gpu_faithful import CHUNKS, MID, T  # noqa: E402,F401


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@contextmanager
def patched(variant):
    saved = [(ops.Linear, "__call__", ops.Linear.__call__), (attention, "rmsnorm", attention.rmsnorm),
             (model, "rmsnorm", model.rmsnorm), (compressor, "rmsnorm", compressor.rmsnorm),
             (attention.Attention, "_attend", attention.Attention._attend),
             (attention.Attention, "__call__", attention.Attention.__call__),
             (moe.MoE, "__call__", moe.MoE.__call__), (attention.Rope, "__call__", attention.Rope.__call__),
             (quant, "act_quant", quant.act_quant), (quant, "indexer_round", quant.indexer_round)]
    full, stores = variant == "full", variant in ("full", "fused")
    if variant in ("q-in", "full"):
        quant.act_quant = lambda x, block=128, f=quant.act_quant: f(bf16(x), block)
        quant.indexer_round = lambda x, f=quant.indexer_round: f(bf16(x))

    def linear(self, x):
        if self.quant_input is not None and variant in ("aq-in", "q-in", "full") or full:
            x = bf16(x)
        if self.quant_input is not None:
            x = self.quant_input(x)
        y = x @ self.w.T
        return bf16(y) if stores else y

    def wrap(f):
        return lambda *a, **k: bf16(f(*a, **k))

    ops.Linear.__call__ = linear
    if full:
        for mod in (attention, model, compressor):
            mod.rmsnorm = wrap(ops.rmsnorm)
    if stores:
        for cls, name, f in saved[4:8]:
            setattr(cls, name, wrap(f))
    try:
        yield
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)


def noisy(ref, seed=1):
    """The reference with every float32 weight array perturbed by 1 + 1e-6·N(0,1), in place on a fresh load."""
    rng = np.random.default_rng(seed)
    seen = set()

    def walk(o):
        if id(o) in seen:
            return
        seen.add(id(o))
        for k, v in list(vars(o).items()) if hasattr(o, "__dict__") else []:
            if isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim >= 2:
                setattr(o, k, v * (1 + 1e-6 * rng.standard_normal(v.shape)).astype(np.float32))
            elif isinstance(v, list):
                for e in v:
                    walk(e)
            elif hasattr(v, "__dict__"):
                walk(v)
    walk(ref)
    return ref


def cases(root):
    from dsv4rt.presets import _BASE
    from dsv4rt.tiny import make_tiny, write_random_checkpoint
    f = dict(np.load(TINY_A / "faithful_fp32.npz"))
    official = make_tiny(root / "official", "tiny", 3, fmt="official")
    mid = write_random_checkpoint(root / "mid", dict(_BASE, **MID), 1, tokenizer=False, fmt="official")
    rng = np.random.default_rng(0)
    return {"tiny-a": (TINY_A, f["input_ids"]), "official": (official, rng.integers(2, 120000, T)),
            "mid": (mid, rng.integers(2, MID["vocab_size"], T))}


def main():
    print(f"{'model':9} {'layer':>5} {'variant':7} {'median':>8} {'p99':>8} {'max':>8} {'<3e-2':>7} {'<2e-2':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (path, ids) in cases(Path(tmp)).items():
            ids = np.asarray(ids, np.int64)
            ref = load_model(path, "faithful")
            streams = []
            ref.forward(ref.new_state(), ids, streams)
            n = len(ids)
            for i in range(ref.cfg.num_layers):
                x = bf16(streams[i])
                want = ref.layer(i, x, ref.new_state(), ids).reshape(n, -1)
                for variant in ("noise", "aq-in", "q-in", "full", "fused"):
                    with patched(variant):
                        m = load_model(path, "faithful")   # built inside: it binds the quant functions
                        m = noisy(m) if variant == "noise" else m
                        got = m.layer(i, x, m.new_state(), ids).reshape(n, -1)
                    err = rel_rows(got, want)
                    print(f"{name:9} {i:5} {variant:7} {np.median(err):8.4f} {np.quantile(err, 0.99):8.4f} "
                          f"{err.max():8.4f} {np.mean(err < 3e-2):7.3f} {np.mean(err < 2e-2):7.3f}", flush=True)


if __name__ == "__main__":
    main()
