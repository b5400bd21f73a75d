"""Serving engine on the CPU: scheduler policy over a real BlockManager, exact recompute, aborts, the prefix
cache, the CLI."""
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import TINY_A, rel_rows, soak
from dsv4rt.chat import EOS
from dsv4rt.config import ModelConfig
from dsv4rt.engine import Engine, PrefixCache, Request, Scheduler, Status, block_hashes
from dsv4rt.engine.gpu_runner import GpuRunner
from dsv4rt.kv.blocks import BlockManager
from dsv4rt.kv.plan import build_plan
from dsv4rt.kv.slab import SlabAllocator
from dsv4rt.model.forward import Entry
from dsv4rt.model.inputs import DecodeRows, SamplingArrays, StepInputs
from dsv4rt.model.tables import PageTables
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny
from test_blocks import HostArena

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
    cramped = Engine(tiny, kv_bytes=6 * SLAB, slab_bytes=SLAB, max_batched_tokens=16)
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


def test_warm_up_leaves_nothing_behind_and_changes_no_generation(tiny):
    e = Engine(tiny)
    cold = e.generate(["The weather today"], GREEDY)[0].token_ids
    e.warm_up()
    assert not e.has_unfinished() and used_pages(e.scheduler.blocks) == [0, 0, 0]
    assert e.scheduler.blocks.allocator.free_slabs == e.scheduler.blocks.allocator.n_slabs
    assert e.generate(["The weather today"], GREEDY)[0].token_ids == cold


def test_engine_errors(tiny):
    from dsv4rt.cuda.driver import gpu_visible
    if not gpu_visible():
        with pytest.raises(ValueError, match="no NVIDIA GPU is visible"):
            Engine(tiny, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        Engine(tiny, device="tpu")
    e = Engine(tiny, kv_bytes=6 * SLAB, slab_bytes=SLAB)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("")
    with pytest.raises(ValueError, match="can never fit"):
        e.add_request([3] * 400, SamplingParams(max_new_tokens=100))
    assert not e.has_unfinished()


class RandomRunner:
    """Stands in for the model: random tokens among a few ids (EOS among them), and checks
    that every step continues each request where its previous one stopped."""

    def __init__(self, scheduler: Scheduler, seed: int):
        self.scheduler, self.rng, self.fed = scheduler, np.random.default_rng(seed), {}

    def run(self, step):
        check_step(self.scheduler, step)
        for r, n in step:
            assert self.fed.get(r.id, 0) == r.computed or r.computed == 0
            assert (r.computed + n) % 256 == 0 or (r.computed + n) // 256 == r.computed // 256   # one block at most
            self.fed[r.id] = r.computed + n
        return [int(self.rng.integers(0, 16)) if r.computed + n == r.num_tokens else None for r, n in step]

    def release(self, request_id):
        self.fed.pop(request_id, None)

    def snapshot(self, request_id):
        return self.fed[request_id]

    def restore(self, request_id, snapshot):
        self.fed[request_id] = snapshot

    def discard(self, snapshot):
        pass


def test_soak_random_requests_and_aborts(tiny):
    rng = np.random.default_rng(1)
    e = Engine(tiny, kv_bytes=16 * SLAB, slab_bytes=SLAB, max_batched_tokens=64, max_running=16)
    e.runner = RandomRunner(e.scheduler, seed=2)
    shared = rng.integers(2, 1000, 300)
    _, aborted = soak(e, rng, 200, shared, arrivals=4, max_new=21, shared_share=0.5, vocab=1000)
    assert e.scheduler.preemptions > 0 and aborted and e.prefix.stats.hits > 0
    assert used_pages(e.scheduler.blocks) == [0, 0, 0] and not e.prefix._held


def test_step_inputs_of_decode_rows_equal_those_of_entries():
    rng = np.random.default_rng(7)
    n = 5
    slot, ids, pos = rng.permutation(8)[:n], rng.integers(2, 1000, n), rng.integers(0, 5000, n)
    sampling = SamplingArrays(rng.random(n, np.float32), rng.integers(0, 50, n, np.int32), rng.random(n, np.float32),
                              rng.integers(0, 1 << 62, n, np.uint64), rng.integers(0, 100, n, np.uint64))
    entries = [Entry(int(s), np.array([i], np.int32), int(p)) for s, i, p in zip(slot, ids, pos)]
    rows = DecodeRows(slot.astype(np.int32), ids.astype(np.int32), pos.astype(np.int32))
    for kw in (dict(pad_to=8, sampling=sampling), dict(every_row=False, sampling=sampling), dict(every_row=False)):
        a, b = StepInputs(16), StepInputs(16)
        a.host[:], b.host[:] = 0xAB, 0xCD            # what earlier steps left
        assert a.fill(entries, **kw) == b.fill(rows, **kw) and a.n_out == b.n_out
        T = kw.get("pad_to", n)
        for name, view in a.view.items():
            if name == "tokens":                      # the sampler's output
                continue
            rows_written = T if name in ("ids", "pos", "req") else a.n_out
            assert np.array_equal(view[:rows_written], b.view[name][:rows_written]), (kw, name)
        assert list(a.view["req"][:T]) == list(slot) + [-1] * (T - n)
        given = sampling.temperature if "sampling" in kw else np.zeros(n, np.float32)
        assert list(a.view["temperature"][:a.n_out]) == list(given) + [0.0] * (a.n_out - n)


def next_token(token, pos, seed, step):
    """What HostModel samples: a function of the output row's inputs (1 is EOS)."""
    token, pos, seed, step = (np.asarray(x).astype(np.int64) for x in (token, pos, seed, step))
    return (token * 31 + pos * 7 + seed * 13 + step * 3) % 40 + 1


class HostModel:
    """GpuModel's host side, for the GPU runner without a GPU: the block manager, page tables in host
    memory, the step inputs; each launch checks the page tables of its rows' slots and 'samples'
    next_token of every output row's inputs."""

    def __init__(self, blocks: BlockManager, max_batch: int, rows: int, max_len: int):
        self.blocks, self.allocator, self.max_batch, self.rows = blocks, blocks.allocator, max_batch, rows
        self.tables = PageTables(HostArena(), blocks.plan, blocks.allocator, max_len, max_batch)
        self.inputs, self.rt = StepInputs(rows), SimpleNamespace(stream=None)
        self.check_tables = None      # a GPU runner: each launch checks the tables of its slots
        self.uploads = Counter()      # by (rows as DecodeRows, padded)

    def upload(self, entries, pad_to=0, every_row=True, sampling=None):
        self.uploads[isinstance(entries, DecodeRows), pad_to > len(entries)] += 1
        return self.inputs.fill(entries, pad_to, every_row, sampling)

    def launch(self, T, n_out, sample):
        if self.check_tables is None:
            return
        owner = {slot: rid for rid, slot in self.check_tables.slots.items()}
        device = self.tables.device.bytes.view(np.int64).reshape(self.max_batch, -1)
        for slot in set(self.inputs.view["req"][:T].tolist()) - {-1}:
            for (kind, layer), (at, cols, k) in self.tables.at.items():
                ids = self.blocks.table(owner[slot], kind, layer)[:cols]
                assert np.array_equal(device[slot, at:at + len(ids)], self.allocator.offsets(ids, k.size_class))

    def outputs(self, n, every_row=False, sampled=False):
        assert sampled
        v = self.inputs.view
        rows = v["out_rows"][:n]
        return next_token(v["ids"][rows], v["pos"][rows], v["seed"][:n], v["step"][:n]).astype(np.int32)

    def run(self, entries, *, every_row=False, sampling=None, pad_to=0):
        T = self.upload(entries, pad_to, every_row, sampling)
        self.launch(T, self.inputs.n_out, sampling is not None)
        return self.outputs(len(entries), every_row, sampling is not None)


def host_gpu_engine(model, **kw) -> Engine:
    """A CPU engine whose runner is the GPU runner over HostModel (no prefix cache: snapshots are device copies)."""
    e = Engine(model, prefix_cache_blocks=0, **kw)
    s = e.scheduler
    e.runner = GpuRunner(HostModel(s.blocks, s.max_running, max(s.token_budget, s.max_running), 4096), graphs=False)
    return e


def test_gpu_runner_uploads_each_rows_token_position_slot_and_sampling(tiny):
    """The GPU runner's host side through decode, padded, mixed and preempted steps with aborts: every
    token is next_token of the request's previous token, position, seed and tokens generated so far,
    and the page tables a launch reads show the pages of its rows' requests."""
    rng = np.random.default_rng(6)
    e = host_gpu_engine(tiny, kv_bytes=16 * SLAB, slab_bytes=SLAB, max_batched_tokens=48, max_running=12)
    e.runner.model.check_tables = e.runner
    requests, aborted = soak(e, rng, 150, rng.integers(2, 1000, 300), arrivals=4, max_new=40, shared_share=0.3,
                             vocab=1000)
    assert e.scheduler.preemptions > 0 and aborted
    assert set(e.runner.model.uploads) == {(True, True), (True, False), (False, False)}
    for r in requests:
        tokens = list(r.prompt)
        for k, token in enumerate(r.generated):
            assert token == next_token(tokens[-1], len(tokens) - 1, r.sample_seed, k), (r.id, k)
            tokens.append(token)
        if r.finish_reason == "stop":
            assert next_token(tokens[-1], len(tokens) - 1, r.sample_seed, len(r.generated)) == EOS
    assert used_pages(e.scheduler.blocks) == [0, 0, 0] and not e.runner.slots


def test_decode_steps_repeated_without_deciding_equal_steps_decided_afresh():
    """The scheduler reuses the last step's decodes while every running request decodes and none waits;
    a scheduler that decides every step gets the same steps through arrivals, stops, aborts, preemption."""
    def drive(fresh: bool) -> list:
        s, rng, log = scheduler(slabs=24, budget=24, max_running=12), np.random.default_rng(8), []
        live = []
        for i in range(800):
            for _ in range(rng.poisson(0.25) if i < 600 else 0):
                live.append(request(len(live), int(rng.integers(1, 20)), max_new=int(rng.integers(1, 40))))
                s.add(live[-1])
            if live and rng.random() < 0.02:
                s.abort(live[rng.integers(len(live))].id)
            if fresh:
                s._decodes = None
            step = s.schedule()
            log.append([(r.id, n) for r, n in step])
            for r, n in step:
                r.computed += n
                if not r.remaining:
                    if rng.random() < 0.05:
                        s.finish(r, "stop")
                        continue
                    r.generated.append(7)
                    if len(r.generated) == r.params.max_new_tokens:
                        s.finish(r, "length")
        assert s.preemptions > 0 and sum(len(step) > 4 for step in log) > 100 and not len(s)
        return log
    assert drive(fresh=False) == drive(fresh=True)


def test_block_hashes_are_chained():
    tokens = np.random.default_rng(5).integers(0, 129280, 3 * 256 + 100).tolist()
    h = block_hashes(tokens)
    assert len(h) == 3 and len(set(h)) == 3 and all(len(x) == 16 for x in h)
    block_1 = np.asarray(tokens[256:512], "<i4").tobytes()
    assert h[1] == hashlib.blake2b(h[0] + block_1, digest_size=16).digest()
    assert block_hashes(tokens[:3 * 256]) == h and block_hashes(tokens[:3 * 256 - 1]) == h[:2]
    assert block_hashes(tokens, h[:2]) == h and block_hashes(tokens[:255]) == []
    changed = list(tokens)
    changed[256 + 17] += 1
    h2 = block_hashes(changed)
    assert h2[0] == h[0] and h2[1] != h[1] and h2[2] != h[2]
    again = block_hashes(tokens[:256] * 2)
    assert again[0] == h[0] and again[1] != again[0]       # the same block after another prefix


def test_prefix_cache_evicts_least_recently_used_unheld_entries():
    with pytest.raises(ValueError):
        PrefixCache(0)
    c = PrefixCache(3)
    keys = [bytes([i]) * 16 for i in range(6)]
    for i in range(3):
        c.insert(keys[i], i + 1, f"s{i}")
    assert c.lookup(keys[:1]) == (1, "s0")            # now 0 is the most recently used
    c.acquire(keys[1])
    c.insert(keys[3], 4, "s3")
    assert keys[2] not in c and len(c) == 3           # 2 is the oldest unheld entry
    assert c.lookup(keys[:4]) == (4, "s3") and c.lookup(keys[:3]) == (2, "s1") and c.lookup(keys[5:]) == (0, None)
    c.insert(keys[4], 5, "s4")
    assert keys[0] not in c and keys[1] in c
    c.acquire(keys[3])
    c.acquire(keys[4])
    c.insert(keys[5], 6, "s5")                        # every other entry is held: the new one goes
    assert keys[5] not in c and len(c) == 3
    c.release(keys[1])
    c.insert(keys[5], 6, "s5")
    assert keys[1] not in c and keys[5] in c
    assert (c.stats.hits, c.stats.blocks_reused, c.stats.tokens_skipped, c.stats.evictions) == (3, 11, 11 * 256, 4)


class Recording:
    """Wraps the reference model: keeps the logits of every position it computes."""

    def __init__(self, model):
        self.model, self.rows = model, {}

    def new_state(self):
        return self.model.new_state()

    def forward(self, state, ids):
        start = state.pos
        logits = self.model.forward(state, ids)
        self.rows.update(enumerate(logits, start))
        return logits


def test_a_prefix_hit_gives_the_logits_of_a_cold_run(tiny):
    rng = np.random.default_rng(3)
    base = rng.integers(2, 120000, 700).tolist()
    one = SamplingParams(temperature=0, max_new_tokens=1)
    e = Engine(tiny, max_batched_tokens=256)
    e.generate([base], one)
    assert len(e.prefix) == 2 and e.prefix.stats.hits == 0       # the states at 256 and 512
    e.runner.model = recording = Recording(e.model)
    for shared in (256, 300, 512, 515, 640):
        prompt = base[:shared] + [base[shared] + 1] + rng.integers(2, 120000, 8).tolist()
        recording.rows.clear()
        e.generate([prompt], one)
        start = shared // 256 * 256                               # full blocks only
        assert sorted(recording.rows) == list(range(start, len(prompt)))
        hit = np.stack([recording.rows[p] for p in range(start, len(prompt))])
        assert rel_rows(hit, e.model.logits_chunked(prompt)[start:]).max() <= 1e-5
    assert (e.prefix.stats.hits, e.prefix.stats.blocks_reused, e.prefix.stats.tokens_skipped) == (5, 8, 8 * 256)


def test_a_chunk_ends_at_the_last_block_boundary_it_crosses_and_the_cache_keeps_that_one(tiny):
    """Steps of any size: a 700-token prompt runs as 512 + 188 tokens, snapshotted at 512 only; the next turn of
    that history resumes there."""
    rng = np.random.default_rng(5)
    base = rng.integers(2, 120000, 700).tolist()
    one = SamplingParams(temperature=0, max_new_tokens=1)
    e = Engine(tiny)
    e.runner.model = recording = Recording(e.model)
    steps = []
    run = e.runner.run
    e.runner.run = lambda step: steps.append([n for _, n in step]) or run(step)
    e.generate([base], one)
    assert steps == [[512], [188]] and len(e.prefix) == 1
    recording.rows.clear()
    e.generate([base + [7, 8, 9]], one)
    assert sorted(recording.rows) == list(range(512, 703)) and e.prefix.stats.hits == 1


def test_greedy_generations_are_the_same_with_the_prefix_cache(tiny):
    rng = np.random.default_rng(4)
    base = rng.integers(2, 120000, 600).tolist()
    first = [base[:250], base[:300] + rng.integers(2, 120000, 20).tolist()]
    then = [base[:520] + [7, 8, 9], base[:256] + [5], base]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    runs = []
    for blocks in (0, 64):
        e = Engine(tiny, prefix_cache_blocks=blocks)
        outs = e.generate(first, params)
        # the decode of the 250-token prompt crossed 256: its state there, generated tokens included, is cached
        grown = first[0] + outs[0].token_ids + [11, 12]
        outs += e.generate(then + [grown], params)
        runs.append([o.token_ids for o in outs])
        assert used_pages(e.scheduler.blocks) == [0, 0, 0]
    assert runs[0] == runs[1] and all(len(ids) == 10 for ids in runs[1])
    # the second batch is admitted in one step, before any of it reaches a new boundary: one block each
    assert e.prefix.stats.hits == 4 and e.prefix.stats.blocks_reused == 4 and not e.prefix._held


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
    assert "tokens/s" in res.stderr and "time to first token" in res.stderr and "prefix cache: 0 hits" in res.stderr
    cold = run_cli(tiny, "--prompts", prompts, "--max-new-tokens", 4, "--temperature", 0, "--json", "--stats",
                   "--no-prefix-cache")
    assert cold.returncode == 0 and cold.stdout == res.stdout and "prefix cache" not in cold.stderr
    raw = run_cli(tiny, "--prompts", prompts, "--max-new-tokens", 4, "--raw", "--seed", 1)
    assert raw.returncode == 0 and raw.stdout.startswith("--- 0 (")
    missing = run_cli(tiny, "--prompts", tmp_path / "none.txt")
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and len(missing.stderr.splitlines()) == 1


def test_the_package_exports_the_serving_api(tiny):
    import dsv4rt
    e = dsv4rt.Engine(tiny)
    (out,) = e.generate([[5, 6, 7]], dsv4rt.SamplingParams(temperature=0, max_new_tokens=3))
    assert len(out.token_ids) <= 3 and out.finish_reason in ("stop", "length")
    with pytest.raises(AttributeError):
        dsv4rt.NoSuchThing
