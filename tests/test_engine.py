"""Serving engine on the CPU: scheduler policy over a real BlockManager, exact recompute, aborts, the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_A
from dsv4rt.config import ModelConfig
from dsv4rt.engine import Engine, Request, Scheduler, Status
from dsv4rt.kv.blocks import BlockManager
from dsv4rt.kv.plan import build_plan
from dsv4rt.kv.slab import SlabAllocator
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
SLAB = 16 << 10       # 4 large pages of the tiny models: a few slabs make a cramped cache
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("engine") / "tiny", "tiny")


def scheduler(slabs: int = 64, budget: int = 16, max_running: int = 8) -> Scheduler:
    plan = build_plan(ModelConfig.load(TINY_A), "exact")
    return Scheduler(BlockManager(plan, SlabAllocator(slabs * SLAB, plan.class_page_bytes, SLAB)), budget, max_running)


def used_pages(blocks: BlockManager) -> list[int]:
    return [blocks.allocator.stats(c).used_pages for c in range(3)]


def request(rid, prompt_len: int, max_new: int = 4) -> Request:
    return Request(rid, list(range(2, 2 + prompt_len)), SamplingParams(max_new_tokens=max_new))


def advance(s: Scheduler, step) -> None:
    """What the engine does after a step, with token 7 always sampled."""
    for r, n in step:
        r.computed += n
        if not r.remaining:
            r.generated.append(7)
            if len(r.generated) == r.params.max_new_tokens:
                s.finish(r, "length")


def check_step(s: Scheduler, step) -> None:
    assert sum(n for _, n in step) <= s.token_budget
    singles = [r.remaining == 1 for r, _ in step]
    assert singles == sorted(singles, reverse=True)          # decodes come first
    for r, n in step:
        assert n >= 1 and s.blocks.length(r.id) == r.computed + n


def test_decodes_first_then_chunked_prefill_under_the_budget():
    s = scheduler(budget=16)
    a, b, c = request("a", 40), request("b", 3), request("c", 5)
    for r in (a, b, c):
        s.add(r)
    steps = []
    for _ in range(4):
        step = s.schedule()
        check_step(s, step)
        steps.append([(r.id, n) for r, n in step])
        advance(s, step)
    assert steps[:3] == [[("a", 16)], [("a", 16)], [("a", 8), ("b", 3), ("c", 5)]]
    assert steps[3] == [("a", 1), ("b", 1), ("c", 1)]
    d = request("d", 30)
    s.add(d)
    step = s.schedule()
    assert [(r.id, n) for r, n in step] == [("a", 1), ("b", 1), ("c", 1), ("d", 13)]


def test_admission_is_first_come_first_served():
    s = scheduler(budget=64, max_running=2)
    reqs = [request(i, 3 + 7 * i % 11, max_new=1 + i % 3) for i in range(6)]
    for r in reqs:
        s.add(r)
    admitted = []
    while len(s):
        step = s.schedule()
        check_step(s, step)
        assert len(s.running) <= 2
        admitted += [r.id for r, _ in step if r.id not in admitted]
        advance(s, step)
    assert admitted == list(range(6)) and s.preemptions == 0
    assert used_pages(s.blocks) == [0, 0, 0]


def test_a_request_that_can_never_fit_is_rejected():
    s = scheduler(slabs=6)
    with pytest.raises(ValueError, match="can never fit.*300 prompt \\+ 20 new tokens"):
        s.add(request("big", 300, max_new=20))
    assert len(s) == 0


def test_preemption_recomputes_exactly(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 120000, n).tolist() for n in (25, 7, 33, 12, 19, 4)]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    alone = Engine(tiny)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    cramped = Engine(tiny, kv_bytes=6 * SLAB, slab_bytes=SLAB, token_budget=16)
    outputs = cramped.generate(prompts, params)
    assert cramped.scheduler.preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert used_pages(cramped.scheduler.blocks) == [0, 0, 0]


def test_stream_matches_generate_and_abort_frees_pages(tiny):
    e = Engine(tiny)
    params = SamplingParams(temperature=0.8, max_new_tokens=8, seed=3)
    (out,) = e.generate(["The weather today"], params)
    assert "".join(e.stream("The weather today", params)) == out.text
    ids = [e.add_request([5, 6, 7, 8] * 5, GREEDY) for _ in range(3)]
    e.step()
    assert sum(used_pages(e.scheduler.blocks)) > 0
    assert e.abort(ids[1]) and not e.abort(ids[1]) and not e.abort("unknown")
    stopped = e.stream("an early stop", SamplingParams(max_new_tokens=50))
    next(stopped)
    stopped.close()                 # closing the stream aborts its request
    while e.has_unfinished():
        e.step()
    assert used_pages(e.scheduler.blocks) == [0, 0, 0]
    assert e.scheduler.blocks.allocator.free_slabs == e.scheduler.blocks.allocator.n_slabs


def test_engine_errors(tiny):
    with pytest.raises(ValueError, match="GPU model runner is not built yet"):
        Engine(tiny, device="cuda")
    e = Engine(tiny, kv_bytes=6 * SLAB, slab_bytes=SLAB)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("")
    with pytest.raises(ValueError, match="can never fit"):
        e.add_request([3] * 400, SamplingParams(max_new_tokens=100))
    assert not e.has_unfinished()


class RandomRunner:
    """Stands in for the model: random logits over a few token ids (EOS among them), and checks
    that every step continues each request where its previous one stopped."""

    def __init__(self, scheduler: Scheduler, seed: int):
        self.scheduler, self.rng, self.fed = scheduler, np.random.default_rng(seed), {}

    def run(self, step):
        check_step(self.scheduler, step)
        for r, n in step:
            assert self.fed.get(r.id, 0) == r.computed or r.computed == 0
            self.fed[r.id] = r.computed + n
        return {r.id: self.rng.standard_normal(16) for r, _ in step}

    def release(self, request_id):
        self.fed.pop(request_id, None)


def test_soak_random_requests_and_aborts(tiny):
    rng = np.random.default_rng(1)
    e = Engine(tiny, kv_bytes=16 * SLAB, slab_bytes=SLAB, token_budget=64, max_running=16)
    e.runner = RandomRunner(e.scheduler, seed=2)
    requests, aborted = [], set()
    while len(requests) < 200 or e.has_unfinished():
        for _ in range(rng.integers(0, 4) if len(requests) < 200 else 0):
            params = SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(1, 21)), seed=len(requests))
            rid = e.add_request(rng.integers(2, 1000, rng.integers(1, 301)).tolist(), params)
            requests.append(e._live[rid])
        if requests and rng.random() < 0.1:
            victim = requests[rng.integers(len(requests))]
            if e.abort(victim.id):
                aborted.add(victim.id)
        e.step()
    assert e.scheduler.preemptions > 0 and aborted
    assert used_pages(e.scheduler.blocks) == [0, 0, 0]
    for r in requests:
        if r.id in aborted:
            assert r.status is Status.ABORTED and r.finish_reason == "abort"
        else:
            assert r.status is Status.FINISHED and r.finish_reason in ("stop", "length")
            assert len(r.generated) <= r.params.max_new_tokens
            assert r.finish_reason == "stop" or len(r.generated) == r.params.max_new_tokens


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "dsv4rt", "generate", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_generate_command(tiny, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nTell me a story\n", encoding="utf-8")
    res = run_cli(tiny, "--prompts", prompts, "--max-new-tokens", 4, "--temperature", 0, "--json", "--stats")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [d["prompt"] for d in lines] == ["Hello there", "Tell me a story"]
    assert all(len(d["token_ids"]) <= 4 and d["finish_reason"] in ("stop", "length") for d in lines)
    assert "tokens/s" in res.stderr and "time to first token" in res.stderr
    raw = run_cli(tiny, "--prompts", prompts, "--max-new-tokens", 4, "--raw", "--seed", 1)
    assert raw.returncode == 0 and raw.stdout.startswith("--- 0 (")
    missing = run_cli(tiny, "--prompts", tmp_path / "none.txt")
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and len(missing.stderr.splitlines()) == 1
