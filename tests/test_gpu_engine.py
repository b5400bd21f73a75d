"""The serving engine on the GPU: batched steps against the CPU engine, decode graphs on and off,
prefix hits against cold runs, and a soak of many requests with aborts."""
import numpy as np
import pytest

from conftest import rel_rows, soak
from dsv4rt.engine import Engine
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SLAB = 16 << 10       # 4 large pages of the tiny model: a few slabs make a cramped cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gpu-engine") / "tiny", "tiny")


def gpu_engine(rt, model, **kw):
    kw = dict(dict(kv_bytes=64 << 20, max_len=4096, max_batched_tokens=256, max_running=16), **kw)
    return Engine(model, "cuda", runtime=rt, **kw)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 120000, n).tolist() for n in lengths]


def test_float32_engine_generates_what_the_cpu_engine_does(rt, tiny):
    batch = prompts(0, (1, 3, 4, 127, 128, 129, 300, 5, 260))
    cpu = Engine(tiny).generate(batch, GREEDY)
    gpu = gpu_engine(rt, tiny, dtype="float32").generate(batch, GREEDY)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=12, seed=7)],
                         ids=["greedy", "sampled"])
def test_decode_graphs_on_and_off_give_the_same_tokens(rt, tiny, params):
    batch = prompts(1, (7, 30, 2, 90, 11))     # 5 requests: the tier of 8, three padded rows
    on = gpu_engine(rt, tiny, graphs=True)
    off = gpu_engine(rt, tiny, graphs=False)
    a, b = on.generate(batch, params), off.generate(batch, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert 8 in on.runner.graphs.graphs
    assert not off.runner.graphs.graphs


def test_a_prefix_hit_gives_the_logits_of_a_cold_run(rt, tiny):
    from dsv4rt.reference import load_model
    ref = load_model(tiny, "exact")
    one = SamplingParams(temperature=0, max_new_tokens=1)
    rng = np.random.default_rng(3)
    base = rng.integers(2, 120000, 700).tolist()
    e = gpu_engine(rt, tiny, dtype="float32")
    e.runner.keep_logits = True
    e.generate([base], one)
    assert len(e.prefix) == 2                                   # the states at 256 and 512
    for shared in (256, 300, 384, 512, 515, 640):               # multiples of 4, 128, 256 and not
        prompt = base[:shared] + [base[shared] + 1] + rng.integers(2, 120000, 8).tolist()
        hits = e.prefix.stats.hits
        (out,) = e.generate([prompt], one)
        assert e.prefix.stats.hits == hits + 1
        cold = ref.logits_chunked(prompt)[-1]
        assert rel_rows(e.runner.logits[out.id][None], cold[None]).max() < 1e-4


def test_soak_of_2000_requests_with_aborts_returns_every_page(rt, tiny):
    rng = np.random.default_rng(1)
    e = gpu_engine(rt, tiny, kv_bytes=24 * SLAB, slab_bytes=SLAB, max_running=32, max_batched_tokens=192)
    shared = rng.integers(2, 120000, 599)
    _, aborted = soak(e, rng, 2000, shared, arrivals=12, max_new=24, shared_share=0.3, vocab=120000)
    a = e.scheduler.blocks.allocator
    assert a.free_slabs == a.n_slabs and aborted and e.scheduler.preemptions > 0
    assert not e.runner.slots and len(e.runner.free_slots) == 32


def test_commands_run_on_the_gpu(tiny, tmp_path):
    import json
    import subprocess
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "dsv4rt", *a], capture_output=True, text=True, timeout=600)
    r = run("chat", str(tiny), "-p", "hello", "--max-new-tokens", "4", "--device", "cuda", "--seed", "1")
    assert r.returncode == 0, r.stderr
    (tmp_path / "p.txt").write_text("hello\nthe weather\n")
    r = run("generate", str(tiny), "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "4", "--stats")
    assert r.returncode == 0 and "GB/s of HBM reads" in r.stderr, r.stderr
    r = run("bench", "decode", "--model", str(tiny), "--batch", "1,3", "--context", "300,2000", "--reps", "3",
            "--json", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [(x["batch"], x["context"]) for x in rows] == [(1, 300), (3, 300), (1, 2000), (3, 2000)]
    assert all(x["step_ms"] > 0 and 0 < x["fraction"] for x in rows)
