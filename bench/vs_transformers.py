"""dsv4rt against Hugging Face transformers on one checkpoint and one GPU: batch-1 decode step time and
logits agreement (with dsv4rt's numpy reference as a third opinion when --with-reference is given).

usage: python bench/vs_transformers.py MODEL_DIR [--context 4096] [--steps 32] [--agree-tokens 256]
                                       [--device cuda] [--with-reference] [--json vs_transformers]
Prints two markdown tables and writes bench/results/NAME.json. The only file of the repo that imports
torch. Without a visible GPU the dsv4rt GPU rows are skipped, so transformers-vs-reference still runs.
"""
import argparse
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

try:
    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM
except ImportError as e:
    print(f"vs_transformers: needs torch and transformers with DeepseekV4ForCausalLM ({e})")
    sys.exit(2)

import ml_dtypes
import numpy as np

from results import save
from dsv4rt.config import ModelConfig
from dsv4rt.cuda.driver import gpu_visible

SEED = 0
WARMUP = 3
PREFILL_CHUNK = 1024  # bounds the eager attention's score tensors while filling transformers' cache
NO_GPU = "skipped: no GPU visible"


def attempt(what: str, work):
    """(result, None), or (None, the error's first line) after printing its traceback: an out-of-memory
    or a missing command becomes a row of the tables instead of ending the run."""
    print(f"{what} ...", flush=True)
    try:
        return work(), None
    except Exception as e:
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


# --- transformers ------------------------------------------------------------------------------------
def load_hf(model_dir: str, device: str):
    """bf16 model on `device`; every stored weight must land on a parameter and none may stay random."""
    device_map = device if importlib.util.find_spec("accelerate") else None  # accelerate loads straight to GPU
    model, info = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=device_map,
                                                        output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"vs_transformers: transformers did not load {model_dir} cleanly: {json.dumps(bad)[:2000]}")
    return model.to(device).eval()


def cache_kwarg(model) -> str:
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bf16_autocast(device: str):
    """transformers 5.17 keeps the hyper-connection streams in float32 and then feeds them to bf16
    Linear layers (a dtype error on the H200); autocast runs those matmuls in bf16."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda"))


@torch.inference_mode()
def hf_logits(model, ids: np.ndarray, device: str) -> np.ndarray:
    x = torch.from_numpy(ids).to(device)[None]
    with bf16_autocast(device):
        return model(input_ids=x, use_cache=False).logits[0].float().cpu().numpy()


@torch.inference_mode()
def hf_decode_ms(model, prompt: np.ndarray, steps: int, device: str) -> float:
    """Median ms of a greedy batch-1 step (forward + argmax) after prefilling `prompt` into the cache."""
    from transformers import DynamicCache
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    x = torch.from_numpy(prompt).to(device)[None]
    with bf16_autocast(device):
        return _timed_steps(model, x, cache, kw, steps, device)


def _timed_steps(model, x, cache, kw: str, steps: int, device: str) -> float:
    for a in range(0, x.shape[1], PREFILL_CHUNK):
        logits = model(input_ids=x[:, a:a + PREFILL_CHUNK], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    tok = logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for i in range(WARMUP + steps):
        sync(device)
        t0 = time.perf_counter()
        tok = model(input_ids=tok, use_cache=True, **{kw: cache}).logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_transformers(a, prompt: np.ndarray, agree_ids: np.ndarray, res: dict):
    """Load, then logits of `agree_ids` (returned as (logits, error)) and the decode row (into `res`)."""
    print("transformers: loading ...", flush=True)
    t0 = time.perf_counter()
    model = load_hf(a.model_dir, a.device)
    res["transformers_load_s"] = round(time.perf_counter() - t0, 1)
    res["attn_implementation"] = model.config._attn_implementation
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    out = attempt("transformers: logits", lambda: hf_logits(model, agree_ids, a.device))
    step_ms, err = attempt("transformers: decode", lambda: hf_decode_ms(model, prompt, a.steps, a.device))
    res["decode"]["transformers"] = {"error": err} if err else {"step_ms": step_ms}
    return out


# --- dsv4rt ------------------------------------------------------------------------------------------
def dsv4rt_decode(model_dir: str, context: int) -> dict:
    """The batch-1 row of `dsv4rt bench decode` (its KV cache filled with random entries, not a prefill),
    run as its own process: it takes most of the GPU's memory. dsv4rt.cli has no __main__ module and a
    PYTHONPATH checkout has no console script, so call what the console script calls."""
    print("dsv4rt bench decode ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        cmd = [sys.executable, "-c", "from dsv4rt.cli import main; main()", "bench", "decode", "--model", model_dir,
               "--batch", "1", "--context", str(context), "--json", str(out)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return {"error": "dsv4rt bench decode: no result after 900 s"}
        if p.returncode != 0 or not out.exists():
            tail = (p.stderr.strip() or p.stdout.strip() or "no output").splitlines()[-1]
            return {"error": f"dsv4rt bench decode exited {p.returncode}: {tail}"[:300]}
        rows = json.loads(out.read_text())["rows"]
    row = next((r for r in rows if r.get("batch") == 1 and r.get("context") == context), rows[0])
    if row.get("step_ms") is None:
        return {"error": f"dsv4rt bench decode: {row.get('note') or 'no step time'}"}
    return {k: row[k] for k in ("step_ms", "roofline_ms", "fraction", "host_us") if k in row}


def dsv4rt_gpu_logits(model_dir: str, ids: np.ndarray) -> np.ndarray:
    from dsv4rt.model.forward import GpuModel
    m = GpuModel(model_dir, ml_dtypes.bfloat16, max_len=len(ids))
    try:
        return m.forward(ids)
    finally:
        m.rt.close()


def reference_logits(model_dir: str, ids: np.ndarray) -> np.ndarray:
    from dsv4rt.reference import load_model
    m = load_model(model_dir, "exact")
    return m.forward(m.new_state(), ids)


# --- report ------------------------------------------------------------------------------------------
def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """Per-position ‖a−b‖/‖b‖ (median, max) and how often the two argmaxes agree."""
    rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    return {"median_rel": float(np.median(rel)), "max_rel": float(rel.max()),
            "argmax_agree": float(np.mean(a.argmax(-1) == b.argmax(-1)))}


def fmt(x, spec=".3f") -> str:
    return "" if x is None else format(x, spec)


def print_tables(res: dict):
    d = res["decode"]
    print(f"\n| decode, batch 1, context {res['context']} | ms/step | tokens/s | roofline ms | fraction | note |")
    print("|---|---|---|---|---|---|")
    for name, r in d.items():
        ms = r.get("step_ms")
        print(f"| {name} | {fmt(ms, '.2f')} | {fmt(ms and 1e3 / ms, '.1f')} | {fmt(r.get('roofline_ms'), '.2f')} "
              f"| {fmt(r.get('fraction'), '.2f')} | {r.get('error', '')} |")
    hf, ours = d["transformers"].get("step_ms"), d["dsv4rt"].get("step_ms")
    if hf and ours:
        print(f"\ndsv4rt decodes {hf / ours:.1f}x faster than transformers")
    print(f"\n| logits, {res['agree_tokens']} tokens: a vs b | median ‖a−b‖/‖b‖ | max | argmax agree | note |")
    print("|---|---|---|---|---|")
    for r in res["agreement"]:
        print(f"| {r['a']} vs {r['b']} | {fmt(r.get('median_rel'), '.2e')} | {fmt(r.get('max_rel'), '.2e')} "
              f"| {fmt(r.get('argmax_agree'))} | {r.get('error', '')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (after 3 warm-up steps)")
    ap.add_argument("--agree-tokens", type=int, default=256, help="prompt tokens of the logits comparison")
    ap.add_argument("--device", default="cuda", help="transformers' device")
    ap.add_argument("--with-reference", action="store_true", help="also compare with the numpy reference")
    ap.add_argument("--json", default="vs_transformers", help="results name: bench/results/NAME.json")
    a = ap.parse_args()

    cfg = ModelConfig.load(a.model_dir)
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(2, cfg.vocab_size, a.context).astype(np.int64)
    agree_ids = rng.integers(2, cfg.vocab_size, a.agree_tokens).astype(np.int64)
    gpu = gpu_visible()
    res = {"model": str(Path(a.model_dir).resolve()), "device": a.device,
           "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
           "torch": torch.__version__, "transformers": transformers.__version__, "seed": SEED,
           "context": a.context, "steps": a.steps, "warmup": WARMUP, "agree_tokens": a.agree_tokens,
           "decode": {}, "agreement": []}

    # dsv4rt's decode runs first, in its own process, before torch holds any GPU memory
    res["decode"]["dsv4rt"] = dsv4rt_decode(a.model_dir, a.context) if gpu else {"error": NO_GPU}

    logits, errors = {}, {}
    logits["transformers"], errors["transformers"] = run_transformers(a, prompt, agree_ids, res)
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the dsv4rt model below sizes its arena from the free memory

    if gpu:
        logits["dsv4rt-gpu"], errors["dsv4rt-gpu"] = attempt(
            "dsv4rt-gpu: logits", lambda: dsv4rt_gpu_logits(a.model_dir, agree_ids))
    else:
        logits["dsv4rt-gpu"], errors["dsv4rt-gpu"] = None, NO_GPU
    if a.with_reference:
        logits["reference"], errors["reference"] = attempt(
            "reference: logits", lambda: reference_logits(a.model_dir, agree_ids))

    for x, y in (("dsv4rt-gpu", "transformers"), ("transformers", "reference"), ("dsv4rt-gpu", "reference")):
        if y not in logits:
            continue
        broken = [errors[k] for k in (x, y) if errors[k]]
        res["agreement"].append({"a": x, "b": y} | ({"error": "; ".join(broken)} if broken
                                                    else agreement(logits[x], logits[y])))

    print_tables(res)
    print(f"\nwrote {save(a.json, res)}")


if __name__ == "__main__":
    main()
