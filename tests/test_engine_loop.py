"""The engine loop: many threads and asyncio tasks share one Engine; aborts free pages; a failing step
ends its readers with the error and the loop serves on; a sink takes each step's news at once."""
import asyncio
import threading

import numpy as np
import pytest

from conftest import used_pages
from dsv4rt.engine import Engine, EngineLoop
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("loop") / "tiny", "tiny")


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(2, 120000, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def test_threads_calling_generate_at_once_get_what_one_caller_gets(tiny):
    batch = prompts(8)
    params = [SamplingParams(temperature=0.9, max_new_tokens=6, seed=i) for i in range(8)]
    expected = [o.token_ids for o in Engine(tiny).generate(batch, params)]
    e = Engine(tiny)
    got, errors = {}, []

    def work(i):
        try:
            for j in (i, i + 4):
                got[j] = e.generate([batch[j]], params[j])[0].token_ids
        except Exception as exc:        # noqa: BLE001 - the assertion below shows it
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [got[j] for j in range(8)] == expected
    assert used_pages(e) == 0 and not e.has_unfinished()


def test_a_bare_string_is_one_prompt(tiny):
    e = Engine(tiny)
    params = SamplingParams(temperature=0, max_new_tokens=3)
    (one,) = e.generate("Hello", params)
    assert one.prompt_ids == e.tokenizer.encode("Hello", add_special_tokens=False).ids
    assert one.token_ids == e.generate(["Hello"], params)[0].token_ids


def test_asyncio_tasks_stream_and_a_cancelled_one_frees_its_pages(tiny):
    e = Engine(tiny)
    batch = prompts(4)
    params = SamplingParams(temperature=0, max_new_tokens=5)
    expected = [o.token_ids for o in Engine(tiny).generate(batch, params)]

    async def read(prompt):
        stream = e.loop.submit(prompt, params, asyncio.get_running_loop())
        return [t async for ids in stream for t in ids], stream.finish_reason

    async def abandon():
        stream = e.loop.submit(prompts(1)[0], SamplingParams(max_new_tokens=10_000), asyncio.get_running_loop())
        async for _ in stream:
            break                        # leaving the loop cancels the request

    async def main():
        return await asyncio.gather(abandon(), *(read(p) for p in batch))
    _, *results = asyncio.run(main())
    assert [ids for ids, _ in results] == expected
    assert all(reason in ("stop", "length") for _, reason in results)
    for _ in range(200):                 # the abort lands between two steps of the loop thread
        if not e.has_unfinished() and e.loop._thread is None:
            break
        threading.Event().wait(0.05)
    assert not e.has_unfinished() and used_pages(e) == 0


def test_closing_a_thread_stream_frees_pages_before_it_returns(tiny):
    e = Engine(tiny)
    stream = e.loop.submit([5, 6, 7], SamplingParams(max_new_tokens=10_000))
    next(iter(stream))
    stream.close()
    assert stream.finish_reason == "abort" and used_pages(e) == 0 and not e.has_unfinished()


def test_a_failing_step_ends_its_readers_with_the_error_and_the_loop_goes_on(tiny):
    e = Engine(tiny)
    run = e.runner.run
    calls = []

    def broken(step):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of host memory")
        return run(step)
    e.runner.run = broken
    stream = e.loop.submit([5, 6, 7], SamplingParams(max_new_tokens=50))
    with pytest.raises(MemoryError, match="out of host memory"):
        stream.result()
    assert used_pages(e) == 0 and not e.has_unfinished()
    (out,) = e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=3))
    assert out.finish_reason in ("stop", "length")


def test_a_bad_request_raises_in_the_caller(tiny):
    e = Engine(tiny, max_len=64)
    with pytest.raises(ValueError, match="exceed the engine's max_len 64"):
        e.loop.submit([5] * 60, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="the prompt is empty"):
        e.generate([""])
    assert e.loop._thread is None and not e.has_unfinished()


def test_a_sink_takes_each_steps_news_for_every_stream_in_one_call(tiny):
    batch = prompts(3)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    expected = [o.token_ids for o in Engine(tiny).generate(batch, params)]
    e = Engine(tiny)
    calls = []
    loop = EngineLoop(e, calls.append)

    def drain():
        for _ in range(400):
            if loop._thread is None and not e.has_unfinished():
                return
            threading.Event().wait(0.05)
    ids = [s.id for s in loop.submit_all([(p, params) for p in batch])]
    drain()
    assert len(calls) == loop.steps
    got, ends = {i: [] for i in ids}, {}
    for news in calls:
        assert len({i for i, _, _ in news}) == len(news)
        for i, new, end in news:
            got[i] += new
            if end is not None:
                ends[i] = end
    assert [got[i] for i in ids] == expected and all(ends[i] in ("stop", "length") for i in ids)

    def broken(step):
        raise MemoryError("out of host memory")
    e.runner.run, calls[:] = broken, []
    ids = [s.id for s in loop.submit_all([(p, params) for p in batch])]
    drain()
    ended = [(i, end) for news in calls for i, _, end in news if end is not None]
    assert sorted(i for i, _ in ended) == ids and all(isinstance(end, MemoryError) for _, end in ended)
    assert used_pages(e) == 0
