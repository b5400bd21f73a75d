"""`dsv4rt serve` with the real `openai` client on a tiny CPU model: chat and completions, streaming and not,
usage, stop strings, seeds, every error status, 16 concurrent streams, a disconnect that frees every page,
SIGTERM; the engine process: its refusals, its death, never outliving the server; DSML tool calls and
reasoning fed as tokens through the server's streaming path."""
import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dsv4rt.chat import EOS, StreamDecoder
from dsv4rt.chat.dsml import parse_completion, prompt_ids
from dsv4rt.engine import Engine
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny
from test_dsml import CASES, MALFORMED

openai = pytest.importorskip("openai")   # the dev extra; the GPU image lacks it

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test"
MAX_LEN = 512
HELLO = [{"role": "user", "content": "Hello"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn.getresponse()


def pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def serve_in_thread(server):
    """uvicorn running `server` in a thread of this process: (port, the uvicorn Server, its thread)."""
    import uvicorn
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(server.app(), port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.02)
    return port, web, thread


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Served:
    """A `dsv4rt serve` process on a free port, ready."""

    def __init__(self, model, tmp: Path, *args):
        self.port = free_port()
        self.log = tmp / f"serve-{self.port}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsv4rt", "serve", str(model), "--port", str(self.port),
                                          "--device", "cpu", *map(str, args)], stdout=log, stderr=log, env=env)
        for _ in range(600):
            try:
                if get(self.port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    @property
    def engine_pid(self) -> int:
        return int(re.search(r"\(engine process (\d+)\)", self.log.read_text()).group(1))

    def metrics(self) -> dict[str, float]:
        status, text = get(self.port, "/metrics")
        assert status == 200
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Served(tiny, tmp_path_factory.mktemp("logs"), "--api-key", KEY, "--max-model-len", MAX_LEN,
               "--max-body-bytes", 100_000, "--max-running", 16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny):
    return Engine(tiny)


def expected_chat(engine, messages, params: SamplingParams):
    """(content, completion tokens) the server must give: the Engine's tokens, decoded as the chat path does."""
    ids = prompt_ids(engine.tokenizer, messages)
    (out,) = engine.generate([ids], params)
    decoder = StreamDecoder(engine.tokenizer, skip_special=False)
    text = "".join(decoder.push(t) for t in out.token_ids) + decoder.flush()
    return text, len(out.token_ids) + (out.finish_reason == "stop"), len(ids)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == ["tiny"]
    assert get(server.port, "/health") == (200, "ok\n")


def test_chat_gives_the_engine_tokens_with_usage(server, reference):
    r = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, seed=7, temperature=0.8)
    content, tokens, prompt = expected_chat(reference, HELLO, SamplingParams(temperature=0.8, top_p=1.0,
                                                                            max_new_tokens=6, seed=7))
    assert r.choices[0].message.content == content and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if tokens == 6 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt, tokens, prompt + tokens)
    again = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, seed=7, temperature=0.8)
    assert again.choices[0].message.content == content


def test_chat_streaming_adds_up_to_the_whole_answer(server):
    whole = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=3)
    chunks = list(server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=3, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_from_text_and_from_ids(server, reference):
    ids = reference.tokenizer.encode("The weather", add_special_tokens=False).ids
    (out,) = reference.generate([ids], SamplingParams(temperature=0, max_new_tokens=5))
    for prompt in ("The weather", ids):
        r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
        assert r.choices[0].text == out.text and r.usage.prompt_tokens == len(ids)
    streamed = server.client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_answer(server, stream):
    full = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10, seed=1)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10, seed=1, stop=[stop, "\x00"],
                                              stream=stream)
    if stream:
        chunks = list(r)
        got = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        got, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert got == text[:text.find(stop)] and reason == "stop"


def status_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 2}, "n"), ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"), ({"logprobs": True}, "logprobs"),
    ({"max_tokens": MAX_LEN}, "max_tokens"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * MAX_LEN}]}, "messages"),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice")])
def test_a_bad_field_is_a_400_naming_it(server, fields, param):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, **fields}
    status, error = status_of(lambda: server.client.post("/chat/completions", body=body, cast_to=object))
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"


def test_error_statuses(server, tiny, tmp_path):
    assert status_of(lambda: server.client.chat.completions.create(model="other", messages=HELLO))[0] == 404
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    assert status_of(lambda: wrong.chat.completions.create(model="tiny", messages=HELLO))[0] == 401
    assert status_of(lambda: wrong.models.list())[0] == 401
    big = [{"role": "user", "content": "x" * 200_000}]
    assert status_of(lambda: server.client.chat.completions.create(model="tiny", messages=big))[0] == 413
    r = post(server.port, "/v1/completions", b"{not json")
    assert r.status == 400 and json.loads(r.read())["error"]["message"] == "the request body is not valid JSON"
    status, text = get(server.port, "/v2/nothing")
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"
    m = server.metrics()
    assert m['dsv4rt_requests_total{endpoint="/v1/chat/completions",status="413"}'] >= 1
    # the server kept serving through all of that
    assert server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_16_concurrent_streams_each_get_their_own_tokens(server, reference):
    def one(seed):
        chunks = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, seed=seed,
                                                       stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    for seed in (0, 9, 15):
        assert got[seed] == expected_chat(reference, HELLO, SamplingParams(temperature=1.0, top_p=1.0,
                                                                          max_new_tokens=6, seed=seed))[0]
    assert server.metrics()["dsv4rt_requests_running"] == 0


def test_a_client_that_disconnects_frees_every_page(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 400, "stream": True}
    r = post(server.port, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status == 200 and r.readline().startswith(b"data: ")
    for _ in range(6):
        r.readline()
    assert server.metrics()["dsv4rt_kv_cache_used_pages"] > 0
    r.close()
    for _ in range(100):
        m = server.metrics()
        if m["dsv4rt_requests_running"] == 0 and m["dsv4rt_kv_cache_used_pages"] == 0:
            break
        time.sleep(0.05)
    assert m["dsv4rt_requests_running"] == 0 and m["dsv4rt_kv_cache_used_pages"] == 0
    assert m['dsv4rt_requests_finished_total{reason="abort"}'] >= 1


def test_a_full_queue_is_a_429_and_sigterm_finishes_the_running_request_and_exits_0(tiny, tmp_path):
    s = Served(tiny, tmp_path, "--max-running", 1, "--max-waiting", 1, "--grace-seconds", 60)
    try:
        long = s.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=60, seed=2, stream=True)
        first = next(iter(long))
        for _ in range(100):           # the role chunk can come before the loop thread has taken the request in
            if s.metrics()["dsv4rt_requests_running"] == 1:
                break
            time.sleep(0.05)
        queued = s.client.with_options(timeout=60).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                                                          stream=True)
        for _ in range(100):
            if s.metrics()["dsv4rt_requests_waiting"] == 1:
                break
            time.sleep(0.05)
        status, error = status_of(lambda: s.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2))
        assert status == 429 and "queue is full" in error["message"]
        s.proc.send_signal(signal.SIGTERM)
        rest = list(long)
        assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"
        assert list(queued)[-1].choices[0].finish_reason is not None
        assert s.proc.wait(60) == 0, s.log.read_text()
        assert "Traceback" not in s.log.read_text() and not pid_alive(s.engine_pid)
    finally:
        s.stop()


def test_sigterm_aborts_what_outlasts_the_grace_period(tiny, tmp_path):
    s = Served(tiny, tmp_path, "--grace-seconds", 0.5)
    try:
        long = s.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=100_000 % MAX_LEN, stream=True)
        next(iter(long))
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError):
            list(long)
        assert s.proc.wait(60) == 0, s.log.read_text()
        assert not pid_alive(s.engine_pid)
    finally:
        s.stop()


def test_the_engine_process_ends_with_a_killed_server(tiny, tmp_path):
    s = Served(tiny, tmp_path)
    pid = s.engine_pid
    assert pid_alive(pid)
    s.stop()                       # SIGKILL: the engine process sees its pipe close
    for _ in range(300):
        if not pid_alive(pid):
            break
        time.sleep(0.1)
    assert not pid_alive(pid)


def test_a_request_the_engine_refuses_is_a_400_with_its_message(tiny, tmp_path):
    # 4 slabs of KV cache: the warm-up fits, a request that may run to a million positions never will
    s = Served(tiny, tmp_path, "--kv-gib", 0.008, "--max-model-len", 1 << 20)
    try:
        for stream in (False, True):
            status, error = status_of(lambda: s.client.completions.create(model="tiny", prompt="Hi", stream=stream))
            assert status == 400 and error["param"] == "prompt"
            assert "can never fit" in error["message"] and "shorten the prompt" in error["message"]
        assert s.client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens > 0
        assert s.metrics()["dsv4rt_requests_waiting"] == 0
    finally:
        s.stop()


def test_a_dead_engine_process_ends_the_streams_and_the_server_exits_1(tiny, tmp_path):
    s = Served(tiny, tmp_path)
    try:
        long = s.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=400, stream=True)
        next(iter(long))
        os.kill(s.engine_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="generation failed: the engine process exited unexpectedly"):
            list(long)
        assert s.proc.wait(60) == 1
        log = s.log.read_text()
        assert "error: the engine process exited unexpectedly (exit code -9)" in log and "Traceback" not in log
    finally:
        s.stop()


def test_a_dead_engine_process_makes_health_and_new_requests_503(tiny):
    from dsv4rt.server import EngineProcess, Server
    engine = EngineProcess(tiny, "cpu", max_len=MAX_LEN)
    port, web, thread = serve_in_thread(Server(engine, "tiny"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        long = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=400, stream=True)
        next(iter(long))
        engine.process.kill()
        with pytest.raises(openai.APIError, match="generation failed: the engine process exited unexpectedly"):
            list(long)
        status, text = get(port, "/health")
        assert status == 503 and text.startswith("the engine process exited unexpectedly (exit code -9)")
        status, error = status_of(lambda: client.chat.completions.create(model="tiny", messages=HELLO))
        assert status == 503 and "exited unexpectedly" in error["message"]
    finally:
        web.should_exit = True
        thread.join(10)
        engine.close()


@pytest.fixture(scope="module")
def scripted(tiny):
    """An in-process server whose engine "samples" a scripted completion (its tokens, then EOS) without running
    the model: the scheduler, the engine loop and the server's streaming path are the real ones."""
    from dsv4rt.server import LocalEngine, Server
    engine = Engine(tiny, max_len=8192, prefix_cache_blocks=0)
    script: list[int] = []

    def scripted_run(step):
        if script == [-1]:
            raise MemoryError("out of host memory")
        return [script[len(r.generated)] if len(r.generated) < len(script) else EOS for r, _ in step]
    engine.runner.run = scripted_run
    port, web, thread = serve_in_thread(Server(LocalEngine(engine), "tiny"))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0), script, engine.tokenizer
    web.should_exit = True
    thread.join(10)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def ask(client, thinking: bool, stream: bool):
    r = client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, max_tokens=4000, stream=stream,
                                       extra_body={"chat_template_kwargs": {"thinking": thinking}})
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.content or "", getattr(m, "reasoning_content", None) or "", calls, r.choices[0].finish_reason
    content, reasoning, calls, reason = "", "", [], None
    for chunk in r:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert (getattr(delta, "reasoning", None) or "") == (getattr(delta, "reasoning_content", None) or "")
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in delta.tool_calls or []]
        reason = chunk.choices[0].finish_reason or reason
    return content, reasoning, calls, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name, text, thinking, content, reasoning, calls", CASES, ids=[c[0] for c in CASES])
def test_tool_calls_and_reasoning_through_the_server(scripted, stream, name, text, thinking, content, reasoning, calls):
    client, script, tokenizer = scripted
    script[:] = tokenizer.encode(text, add_special_tokens=False).ids
    got = ask(client, thinking, stream)
    assert got[:3] == (content, reasoning, calls), got[3]
    assert got[3] == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("name, text", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_dsml_is_content_never_a_500(scripted, name, text):
    client, script, tokenizer = scripted
    script[:] = tokenizer.encode(text, add_special_tokens=False).ids
    want = parse_completion(text, False)
    for stream in (False, True):
        content, _, calls, _ = ask(client, False, stream)
        assert content == want["content"] and len(calls) == len(want["tool_calls"])


def test_bench_serve_drives_a_running_server(server, tmp_path):
    from click.testing import CliRunner
    from dsv4rt.cli import main
    from dsv4rt.server.load import workload
    args = ["bench", "serve", "--url", server.url, "--api-key", KEY, "--requests", "6", "--prompt-len", "3,40",
            "--output-len", "2,5", "--seed", "4"]
    first = CliRunner().invoke(main, args + ["--json", str(tmp_path / "a.json")])
    assert first.exit_code == 0, first.output
    (row,) = json.loads((tmp_path / "a.json").read_text())["rows"]
    work = workload(6, (3, 40), (2, 5), 4)
    assert row["where"] == server.url and row["requests"] == 6
    assert row["prompt_tokens"] == sum(len(p) for p, _ in work) and 6 <= row["generated"] <= sum(k for _, k in work)
    assert row["tokens_per_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    second = CliRunner().invoke(main, args + ["--against", str(tmp_path / "a.json")])
    assert second.exit_code == 0 and second.stdout.count(f"| {server.url} |") == 2
    assert second.stdout.startswith("| where | requests | prompt_tokens | generated | seconds | tokens_per_s |")
    neither = CliRunner().invoke(main, ["bench", "serve"])
    assert neither.exit_code == 2 and "give one of --model (in process) and --url (a running server)" in neither.output
    down = CliRunner().invoke(main, ["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}"])
    assert down.exit_code == 1 and "cannot reach the server" in down.output


def test_a_failing_step_is_a_500_or_an_error_event_and_the_server_goes_on(scripted):
    client, script, tokenizer = scripted
    script[:] = [-1]
    status, error = status_of(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3))
    assert status == 500 and error["message"] == "generation failed: out of host memory"
    with pytest.raises(openai.APIError, match="generation failed: out of host memory"):
        list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, stream=True))
    script[:] = tokenizer.encode("Fine.", add_special_tokens=False).ids
    assert client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == "Fine."


@pytest.mark.parametrize("extra", [{"thinking": {"type": "enabled"}}, {"thinking": True},
                                   {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}])
def test_thinking_requested_either_way_returns_reasoning(scripted, extra):
    client, script, tokenizer = scripted
    script[:] = tokenizer.encode("Let me think.</think>Answer.", add_special_tokens=False).ids
    m = client.chat.completions.create(model="tiny", messages=HELLO, extra_body=extra).choices[0].message
    assert (m.content, m.reasoning_content, m.reasoning) == ("Answer.", "Let me think.", "Let me think.")
