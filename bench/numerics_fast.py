"""How far are the fast numerics from faithful (docs/numerics.md#modes)? Fast adds one rounding, act_quant of
wo_a's input, so this measures what that rounding alone does, beside the distance of exact from faithful for scale.

Models (random weights in the released formats, wo_a stored in fp8): "official" (`make-tiny --preset tiny
--format official`), "mid" (tests/test_gpu_faithful.py: widths that are multiples of 128, two wo_a groups) and
"conditioned" (tests/conditioned.py: no routing or indexer choice can flip). Each is fed one prompt of --tokens
random ids. End to end, in one prefill: the largest absolute logit difference, the median and largest relative
error per position (‖a − b‖ / ‖b‖) and the share of positions whose argmax agrees. Layer by layer (each layer fed
the faithful reference's input streams, so that nothing carries over from earlier layers): the median relative
error of the layer's output streams, in the layer where it is largest.

usage: python bench/numerics_fast.py [--device cpu|cuda] [--storage bf16|float32] [--tokens 300] [--json OUT]
--device cpu runs the numpy reference, cuda the GPU build (every numerics on it). Prints a table and writes its
numbers to OUT (default bench/results/numerics_fast.json)."""
import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from results import save

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conditioned import make_conditioned  # noqa: E402
from test_gpu_faithful import MID  # noqa: E402

STORAGE = {"bf16": ml_dtypes.bfloat16, "float32": np.float32}
NUMERICS = ("faithful", "fast", "exact")


def models(root: Path) -> dict[str, Path]:
    from dsv4rt.presets import _BASE
    from dsv4rt.tiny import make_tiny, write_random_checkpoint
    return {"official": make_tiny(root / "official", "tiny", 3, fmt="official"),
            "mid": write_random_checkpoint(root / "mid", dict(_BASE, **MID), 1, tokenizer=False, fmt="official"),
            "conditioned": make_conditioned(root / "conditioned")}


def runs(path: Path, ids: np.ndarray, runtime, storage: str) -> dict:
    """numerics -> (logits, each layer's output streams when fed the faithful reference's input streams), from
    the numpy reference without a runtime, else from the GPU build."""
    from dsv4rt.reference import load_model
    ref, streams = load_model(path, "faithful"), []
    ref.forward(ref.new_state(), ids, streams)
    out = {}
    for x in NUMERICS:
        if runtime is None:
            m = load_model(path, x)
            out[x] = (m.forward(m.new_state(), ids),
                      [m.layer(i, streams[i], m.new_state(), ids) for i in range(m.cfg.num_layers)])
        else:
            from dsv4rt.model.forward import GpuModel
            m = GpuModel(path, STORAGE[storage], runtime=runtime, max_len=len(ids), kv_bytes=64 << 20, numerics=x)
            out[x] = m.forward(ids), [m.layer_alone(i, ids, streams[i]) for i in range(m.cfg.num_layers)]
    return out


def rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def distance(got, want) -> dict:
    """got against want, (logits, layers) each: the figures of docs/numerics.md#tolerances."""
    (a, layers), (b, base) = got, want
    rel = rel_rows(a, b)
    return dict(max_abs=float(np.abs(a.astype(np.float64) - b).max()), median_rel=float(np.median(rel)),
                max_rel=float(rel.max()), argmax_agree=float(np.mean(a.argmax(-1) == b.argmax(-1))),
                layer_median_rel=float(max(np.median(rel_rows(x, y)) for x, y in zip(layers, base))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--storage", choices=tuple(STORAGE), default="bf16", help="the GPU build's (cuda only)")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", help="default: bench/results/numerics_fast.json")
    a = ap.parse_args()
    from dsv4rt.loader import Checkpoint
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        runtime = None
        if a.device == "cuda":
            from dsv4rt.cuda.runtime import Runtime
            runtime = stack.enter_context(Runtime(arena_bytes=8 << 30))
        for name, path in models(Path(tmp)).items():
            with Checkpoint.open(path) as ck:
                vocab = ck.config.vocab_size
            ids = np.random.default_rng(a.seed).integers(2, vocab, a.tokens)
            out = runs(path, ids, runtime, a.storage)
            rows += [dict(model=name, numerics=x, **distance(out[x], out["faithful"])) for x in ("fast", "exact")]
    build = "numpy reference" if a.device == "cpu" else f"GPU {a.storage} build"
    print(f"{build}, {a.tokens} tokens; each numerics against faithful on the same build")
    print(f"{'model':12s} {'numerics':8s} {'max abs':>9s} {'median rel':>11s} {'max rel':>9s} {'argmax':>7s} "
          f"{'layer median rel':>17s}")
    for r in rows:
        print(f"{r['model']:12s} {r['numerics']:8s} {r['max_abs']:9.2e} {r['median_rel']:11.2e} {r['max_rel']:9.2e} "
              f"{r['argmax_agree']:7.3f} {r['layer_median_rel']:17.2e}")
    result = dict(device=a.device, storage=a.storage if a.device == "cuda" else "float32", tokens=a.tokens,
                  seed=a.seed, rows=rows)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    else:
        save("numerics_fast", result)


if __name__ == "__main__":
    main()
