"""Faithful numerics on the GPU (docs/numerics.md): GpuModel(..., numerics="faithful") against the faithful numpy
reference, the engine and the commands on it; without a GPU, which stored formats the faithful build takes.

Models: tiny-a (every weight float32, so faithful means the fp8 main cache and the fp4 indexer keys only; the
reference is stable there to ulp noise, docs/numerics.md#tolerances), "official" (`make-tiny --preset tiny --format official`: fp8
attention GEMMs, fp4 routed and fp8 shared experts) and "mid" (the same format at widths that are multiples of 128,
so that prefill GEMMs of more than 16 rows take the wgmma kernel, and index_head_dim 128, the tensor-core indexer).

Why the released-format models are not checked at 1e-4 at every position: act_quant rounds every GEMM input onto
e4m3, and a value within rounding noise of an e4m3 midpoint lands on either neighbour, a 3-6% step of that element,
which the caches then carry to later tokens (docs/numerics.md#tolerances). Measured with the numpy reference itself (float32
weights times 1 + 1e-6·N(0, 1), the size of float32 reordering noise, 300 tokens): "official" moved 0 to 63 of
the 300 positions by more than 1e-4, up to 3e-2; "mid" moved 95-100% of them by a median 3e-2, about as far as
exact numerics are from faithful. Layer by layer (teacher forcing, inputs times 1 + 1e-6·N) the same noise left
the median error at 5e-7..7e-7 and 76-100% of the tokens within 1e-4 in every layer, while dropping any one of the
three roundings moves the median of the layers it touches to 9e-3..4e-2. So the float32 build of those models is
checked layer by layer on the median, end to end on argmax agreement only; tiny-a is checked at 1e-4 everywhere."""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conditioned import T as CONDITIONED_T, conditioned_ids, make_conditioned
from conftest import TINY_A, rel_rows, replays_the_eager_step
from dsv4rt.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from dsv4rt.loader import Checkpoint, quant_fp4, quant_fp8, scale_name, to_official
from dsv4rt.reference import load_model

gpu = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
MID = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=3, num_attention_heads=2, head_dim=128,
           qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, layer_types=[SLIDING, CSA, HCA],
           mlp_layer_types=[HASH_MOE, MOE, MOE], index_n_heads=4, index_head_dim=128, index_topk=16,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=2)
RELEASED = ("official", "mid")
T = 300                                  # released-format prompts: 2 windows of 128, c128a entries, 75 c4a ones
CHUNKS, SPLIT = [100, 1, 150, 49], 250   # chunked and token-by-token runs of those


class Case:
    """A model folder, its prompt and the reference's runs over it in the given numerics (computed on first use)."""

    def __init__(self, path, ids, chunks, split, numerics="faithful"):
        self.path, self.ids, self.chunks, self.split = path, np.asarray(ids, np.int64), list(chunks), int(split)
        self.numerics = numerics
        self.ref = load_model(path, numerics)
        self._runs = {}

    @property
    def streams(self) -> list:
        """The residual streams entering each layer of the one-prefill run, then the last layer's output."""
        self.run("full")
        return self._streams

    def run(self, mode: str) -> np.ndarray:
        if mode not in self._runs:
            ref, ids = self.ref, self.ids
            if mode == "full":
                self._streams = []
                self._runs[mode] = ref.forward(ref.new_state(), ids, self._streams)
            elif mode == "chunked":
                self._runs[mode] = ref.logits_chunked(ids, self.chunks)
            else:
                self._runs[mode] = incremental(ref.new_state(), lambda st, x: ref.forward(st, x), ids, self.split)
        return self._runs[mode]


def incremental(state, forward, ids, split) -> np.ndarray:
    """The last logits of a `split`-token prefill, then those of each decode step."""
    out = [forward(state, ids[:split])[-1]]
    out += [forward(state, ids[t:t + 1])[0] for t in range(split, len(ids))]
    return np.stack(out)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from dsv4rt.presets import _BASE
    from dsv4rt.tiny import make_tiny, write_random_checkpoint
    f = dict(np.load(TINY_A / "faithful_fp32.npz"))
    chunks = dict(np.load(TINY_A / "golden.npz"))["chunks"]
    root = tmp_path_factory.mktemp("faithful")
    official = make_tiny(root / "official", "tiny", 3, fmt="official")
    mid = write_random_checkpoint(root / "mid", dict(_BASE, **MID), 1, tokenizer=False, fmt="official")
    conditioned = make_conditioned(root / "conditioned")
    rng = np.random.default_rng(0)
    return {"tiny-a": Case(TINY_A, f["input_ids"], chunks, f["split"]),
            "conditioned": Case(conditioned, conditioned_ids(), CHUNKS[:2] + [CONDITIONED_T - 101], SPLIT),
            "official": Case(official, rng.integers(2, 120000, T), CHUNKS, SPLIT),
            "mid": Case(mid, rng.integers(2, MID["vocab_size"], T), CHUNKS, SPLIT)}


_models = {}


def gpu_model(rt, case: Case, dtype):
    from dsv4rt.model.forward import GpuModel
    key = (str(case.path), np.dtype(dtype), case.numerics)
    if key not in _models:
        _models[key] = GpuModel(case.path, dtype, runtime=rt, max_len=1024, kv_bytes=256 << 20, numerics=case.numerics)
    m = _models[key]
    m.reset()
    return m


def gpu_runs(m, case: Case) -> dict:
    out = {"full": m.forward(case.ids)}
    m.reset()
    bounds = np.cumsum([0] + case.chunks)
    out["chunked"] = np.concatenate([m.forward(case.ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    m.reset()
    out["incremental"] = incremental(None, lambda _, x: m.forward(x), case.ids, case.split)
    m.reset()
    return out


# --- tiny-a: the fp8 main cache and the fp4 indexer keys, tightly ---------------------------------------------

@gpu
def test_tiny_a_float32_matches_the_official_code_in_every_run(rt, cases):
    """One prefill and token by token against the official code's logits (faithful_fp32.npz), chunked against the
    faithful reference's chunked run; 1e-4 at every position."""
    case = cases["tiny-a"]
    f = dict(np.load(TINY_A / "faithful_fp32.npz"))
    m = gpu_model(rt, case, np.float32)
    assert m.numerics == "faithful" and not (m.fp8_attention or m.fp4_experts)
    runs = gpu_runs(m, case)
    assert rel_rows(runs["full"], f["logits_full"]).max() < 1e-4
    assert rel_rows(runs["incremental"], f["logits_incr"]).max() < 1e-4
    assert rel_rows(runs["chunked"], case.run("chunked")).max() < 1e-4


@gpu
def test_tiny_a_faithful_differs_from_exact_by_the_quantisation(rt, cases):
    """The roundings are really on: the exact float32 build sits a median 4.6% away (tiny-a's README)."""
    from dsv4rt.model.forward import GpuModel
    case = cases["tiny-a"]
    exact = GpuModel(TINY_A, np.float32, runtime=rt, max_len=256, kv_bytes=64 << 20)
    assert exact.numerics == "exact"           # tiny-a is stored in float32: exact by default
    faithful = gpu_model(rt, case, np.float32).forward(case.ids)
    assert np.median(rel_rows(exact.forward(case.ids), faithful)) > 1e-2


# --- the released formats ---------------------------------------------------------------------------------------

@gpu
def test_conditioned_release_float32_matches_the_reference_in_every_run(rt, cases):
    """tests/conditioned.py: the released formats where no routing or indexer choice can flip; fp8 attention GEMMs,
    fp4 experts with the routing weight before w2's act_quant, fp8 cache, fp4 indexer keys: 1e-4 at every position."""
    case = cases["conditioned"]
    m = gpu_model(rt, case, np.float32)
    assert m.numerics == "faithful" and m.fp8_attention and m.fp4_experts
    runs = gpu_runs(m, case)
    for mode, got in runs.items():
        assert rel_rows(got, case.run(mode)).max() < 1e-4, mode


@gpu
@pytest.mark.parametrize("name", RELEASED)
def test_released_format_float32_layers_with_teacher_forcing(rt, cases, name):
    """Each layer alone, fed the faithful reference's input streams, against its output streams: median within
    1e-4 (see the module's docstring), the share within 1e-4 printed."""
    case = cases[name]
    m = gpu_model(rt, case, np.float32)
    assert m.fp8_attention and m.fp4_experts
    n = len(case.ids)
    for i in range(m.cfg.num_layers):
        ours = m.layer_alone(i, case.ids, case.streams[i]).reshape(n, -1)
        err = rel_rows(ours, case.streams[i + 1].reshape(n, -1))
        print(f"{name} float32 layer {i}: median {np.median(err):.2e}, within 1e-4 {np.mean(err < 1e-4):.3f}, "
              f"max {err.max():.2e}")
        assert np.median(err) < 1e-4, i


@gpu
@pytest.mark.xfail(reason="unattainable for bf16 storage: the H200 gets 47% (official) and 26% (mid) of the tokens "
                          "within 3e-2 at layer 0, tiny-a 88% at layer 2; the numpy reference with its activations "
                          "stored in bf16 gets 44%, 26%, 86% (bench/faithful_bf16_floor.py)", strict=False)
@pytest.mark.parametrize("name", ["tiny-a", *RELEASED])
def test_bf16_layers_with_teacher_forcing(rt, cases, name):
    """Each bf16 layer alone, fed the faithful reference's input streams rounded to bf16, against the reference
    layer on the same inputs: 99% of the tokens within 3e-2 in every layer."""
    case = cases[name]
    m, ref = gpu_model(rt, case, BF16), case.ref
    n = len(case.ids)
    for i in range(m.cfg.num_layers):
        x = case.streams[i].astype(BF16).astype(np.float32)
        ours = m.layer_alone(i, case.ids, x).reshape(n, -1)
        err = rel_rows(ours, ref.layer(i, x, ref.new_state(), case.ids).reshape(n, -1))
        print(f"{name} bf16 layer {i}: median {np.median(err):.4f}, 99th pct {np.quantile(err, 0.99):.4f}, "
              f"within 3e-2 {np.mean(err < 3e-2):.4f}")
        assert np.mean(err < 3e-2) >= 0.99, i


@gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-a", *RELEASED])
def test_end_to_end_statistics(rt, cases, name, dtype):
    """One prefill, chunked and token by token against the reference's runs of the same feeding: median error and
    argmax agreement printed; finite everywhere, the float32 build's argmax agreeing at 80% at least (chaos alone
    kept 88-99% on these models, docs/numerics.md#tolerances), the bf16 build's at 50% (a guard against outright breakage)."""
    case = cases[name]
    m = gpu_model(rt, case, dtype)
    for mode, ours in gpu_runs(m, case).items():
        ref = case.run(mode)
        assert np.isfinite(ours).all(), mode
        err = rel_rows(ours, ref)
        agree = np.mean(ours.argmax(-1) == ref.argmax(-1))
        print(f"{name} {np.dtype(dtype).name} {mode}: median rel {np.median(err):.2e}, max {err.max():.2e}, "
              f"argmax {agree:.3f}")
        assert agree >= (0.8 if dtype == np.float32 else 0.5), mode


@gpu
def test_decode_graphs_replay_the_faithful_step(rt, cases):
    """A bf16 decode step of the released format (fp8 linear layers, fp4 MoE, fp8 cache, fp4 indexer) captured and
    replayed gives the eager step's logits bit for bit."""
    case = cases["official"]
    assert replays_the_eager_step(gpu_model(rt, case, BF16), case.ids, 200, 1)


# --- the engine and the commands --------------------------------------------------------------------------------

GREEDY = dict(temperature=0, max_new_tokens=12)


def prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


@gpu
def test_float32_engine_generates_what_the_cpu_engine_does_on_tiny_a(rt):
    from dsv4rt.engine import Engine
    from dsv4rt.reference.sampling import SamplingParams
    batch = prompts(0, (1, 3, 15, 16, 17, 40, 100, 160), 512)
    cpu = Engine(TINY_A, numerics="faithful").generate(batch, SamplingParams(**GREEDY))
    gpu_engine = Engine(TINY_A, "cuda", numerics="faithful", dtype="float32", runtime=rt, kv_bytes=64 << 20,
                        max_len=1024, max_batched_tokens=64, max_running=8)
    assert gpu_engine.runner.model.numerics == "faithful"
    gpu_out = gpu_engine.generate(batch, SamplingParams(**GREEDY))
    assert [o.token_ids for o in gpu_out] == [o.token_ids for o in cpu]


@gpu
def test_a_faithful_prefix_hit_gives_the_logits_of_a_cold_run(rt):
    """The prefix cache's snapshots of fp8 main entries and fp4 indexer keys (tiny-a, float32 build): a hit gives
    the last logits of a run without the prefix cache, whose tokens after the block it also computes in other
    chunks, to 1e-4 (the reference's own error is printed: more tokens, more chances of a rounding flip)."""
    from dsv4rt.engine import Engine
    from dsv4rt.reference.sampling import SamplingParams
    one = SamplingParams(temperature=0, max_new_tokens=1)
    kw = dict(numerics="faithful", dtype="float32", runtime=rt, kv_bytes=64 << 20, max_len=1024, max_batched_tokens=64,
              max_running=4)
    warm, cold = Engine(TINY_A, "cuda", **kw), Engine(TINY_A, "cuda", prefix_cache_bytes=0, **kw)
    warm.runner.keep_logits = cold.runner.keep_logits = True
    rng = np.random.default_rng(3)
    base = rng.integers(2, 512, 300).tolist()
    warm.generate([base], one)
    ref = load_model(TINY_A, "faithful")
    for shared in (256, 270):
        prompt = base[:shared] + [base[shared] % 511 + 1] + rng.integers(2, 512, 8).tolist()
        hits = warm.prefix.stats.hits
        (hit,), (miss,) = warm.generate([prompt], one), cold.generate([prompt], one)
        assert warm.prefix.stats.hits == hits + 1
        ours = warm.runner.logits[hit.id][None]
        print(f"prefix {shared}: against the reference {rel_rows(ours, ref.logits_chunked(prompt)[-1:]).max():.2e}")
        assert rel_rows(ours, cold.runner.logits[miss.id][None]).max() < 1e-4


@gpu
def test_bf16_engine_serves_the_released_format(rt, cases):
    """Faithful by default for the fp8/fp4 checkpoint; greedy tokens of a batch (prefill chunks and a decode tier of
    several rows) are the same with decode graphs on and off, and mostly the reference's argmax (teacher-forced on
    the generated tokens; bf16 rounding flips act_quant roundings, so not all)."""
    from dsv4rt.engine import Engine
    from dsv4rt.reference.sampling import SamplingParams
    case = cases["official"]
    batch = prompts(1, (7, 30, 2, 130, 11), 120000)
    engines = {g: Engine(case.path, "cuda", runtime=rt, kv_bytes=64 << 20, max_len=1024, max_batched_tokens=256,
                         max_running=8, graphs=g) for g in (True, False)}
    outs = {g: e.generate(batch, SamplingParams(**GREEDY)) for g, e in engines.items()}
    assert engines[True].runner.model.numerics == "faithful"
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert 8 in engines[True].runner.graphs.graphs
    agree = []
    for prompt, out in zip(batch, outs[True]):
        assert len(out.token_ids) == GREEDY["max_new_tokens"] or out.finish_reason == "stop"
        logits = case.ref.logits_chunked(prompt + out.token_ids)[len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)]
        agree += list(logits.argmax(-1) == out.token_ids)
    print(f"generated tokens that are the reference's argmax: {np.mean(agree):.3f} of {len(agree)}")
    assert np.mean(agree) >= 0.7


def dsv4rt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4rt", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@gpu
def test_commands_run_faithful_on_the_gpu(cases, tmp_path):
    f = dict(np.load(TINY_A / "faithful_fp32.npz"))
    np.save(tmp_path / "ids.npy", f["input_ids"])
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cuda",
               "--numerics", "faithful", "--storage", "float32")
    assert r.returncode == 0, r.stderr
    assert rel_rows(np.load(tmp_path / "o.npy"), f["logits_full"]).max() < 1e-4
    official = cases["official"].path
    (tmp_path / "p.txt").write_text("hello\nthe weather\n")
    for numerics in ("faithful", "exact"):
        r = dsv4rt("generate", official, "--prompts", tmp_path / "p.txt", "--max-new-tokens", 4, "--device", "cuda",
                   "--numerics", numerics, "--json")
        assert r.returncode == 0, r.stderr
        assert [json.loads(line)["index"] for line in r.stdout.splitlines()] == [0, 1]
    r = dsv4rt("chat", official, "-p", "hello", "--max-new-tokens", 4, "--device", "cuda", "--seed", 1)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


# --- without a GPU: which stored formats the faithful build takes -----------------------------------------------

ATTENTION = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_b.weight",
             ".attn.indexer.wq_b.weight")
ROUTED, SHARED = ".ffn.experts.", ".ffn.shared_experts."


def tiny_a_stored(folder, fmt) -> Checkpoint:
    """tiny-a in official names with the weights that fmt(name) names 'fp8' or 'fp4' stored so."""
    tensors = {to_official(k): v for k, v in load_file(str(TINY_A / "model.safetensors")).items()}
    out = {}
    for name, w in tensors.items():
        quant = {"fp8": quant_fp8, "fp4": quant_fp4}.get(fmt(name))
        if quant is None:
            out[name] = w
        else:
            out[name], out[scale_name(name)] = quant(w)
    folder.mkdir()
    save_file(out, str(folder / "model.safetensors"))
    (folder / "config.json").write_bytes((TINY_A / "config.json").read_bytes())
    ck = Checkpoint.open(folder)
    ck.validate()
    return ck


def released(name: str) -> str | None:
    if name.endswith(ATTENTION + (".attn.wo_a.weight",)) or SHARED in name and name.endswith(".weight"):
        return "fp8"
    return "fp4" if ROUTED in name and name.endswith(".weight") else None


@pytest.mark.parametrize("fmt, want", [
    (released, (True, True)),
    (lambda n: released(n) if n.endswith(ATTENTION) else None, (True, False)),
    (lambda n: None if n.endswith(ATTENTION) else released(n), (False, True)),
    (lambda n: None, (False, False)),
    (lambda n: "fp8" if n.endswith(".attn.wo_a.weight") else None, (False, False)),
], ids=["released", "attention", "experts", "none", "wo_a"])
def test_released_formats_of_a_checkpoint(tmp_path, fmt, want):
    from dsv4rt.model.linear_fp8 import released_formats
    with tiny_a_stored(tmp_path / "m", fmt) as ck:
        assert released_formats(ck) == want


@pytest.mark.parametrize("fmt, message", [
    (lambda n: "fp8" if n.endswith(".attn.wq_a.weight") else None, "attention fp8/unquantised"),
    (lambda n: "fp8" if ROUTED in n and n.endswith(".weight") else None, "routed experts fp8"),
    (lambda n: "fp4" if ROUTED in n and n.endswith(".weight") else None, "shared expert unquantised"),
    (lambda n: "fp8" if n.endswith(".ffn.gate.weight") else released(n), "layers.0.ffn.gate.weight is stored"),
], ids=["part of attention", "fp8 routed experts", "no fp8 shared expert", "gate"])
def test_other_stored_formats_are_refused(tmp_path, fmt, message):
    from dsv4rt.model.linear_fp8 import released_formats
    with tiny_a_stored(tmp_path / "m", fmt) as ck:
        with pytest.raises(ValueError, match="faithful numerics on the GPU take the released formats") as e:
            released_formats(ck)
    assert message in str(e.value)
