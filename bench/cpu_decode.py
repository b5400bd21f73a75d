"""Tokens per second of the numpy backend on the demo model: prefill and token-by-token decode.

usage: python bench/cpu_decode.py [--model DIR] [--prompt 512] [--decode 64] [--repeats 3]
Prints a table and writes bench/results/cpu_decode.json.
"""
import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from results import save
from dsv4rt.reference import load_model
from dsv4rt.tiny import make_tiny


def run(model, prompt: int, decode: int, rng) -> tuple[float, float]:
    ids = rng.integers(2, model.cfg.vocab_size, prompt + decode)
    st = model.new_state()
    t0 = time.perf_counter()
    model.forward(st, ids[:prompt])
    t1 = time.perf_counter()
    for t in range(prompt, prompt + decode):
        model.forward(st, ids[t:t + 1])
    t2 = time.perf_counter()
    return prompt / (t1 - t0), decode / (t2 - t1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_tiny(Path(tmp) / "demo", "demo")
        model = load_model(path)
    rng = np.random.default_rng(0)
    runs = [run(model, a.prompt, a.decode, rng) for _ in range(a.repeats)]
    prefill, decode = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    result = dict(model=str(a.model or "demo preset"), machine=platform.processor() or platform.machine(),
                  prompt_tokens=a.prompt, decode_tokens=a.decode, repeats=a.repeats,
                  prefill_tok_s=round(prefill, 1), decode_tok_s=round(decode, 1))
    print(f"{'phase':10s} {'tokens':>7s} {'tok/s (median of ' + str(a.repeats) + ')':>24s}")
    print(f"{'prefill':10s} {a.prompt:7d} {prefill:24.1f}")
    print(f"{'decode':10s} {a.decode:7d} {decode:24.1f}")
    save("cpu_decode", result)


if __name__ == "__main__":
    main()
