"""`dsv4rt bench serve --url`: N streaming clients at once against a running server, the same workload
as the in-process `bench serve --model` (dsv4rt/benchmarks.py), measured from the client's side."""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import numpy as np

PROMPT_VOCAB = 100_000     # prompt ids are drawn from [2, this): ordinary tokens in every V4 vocabulary


def workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, new tokens) pairs of random lengths in the given [min, max] ranges."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    outs = rng.integers(output_len[0], output_len[1] + 1, n)
    return [(rng.integers(2, PROMPT_VOCAB, int(L)).tolist(), int(k)) for L, k in zip(lens, outs)]


class _Client:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url {url}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=3600)
        conn.request(method, path, json.dumps(body) if body is not None else None, self.headers)
        response = conn.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"{method} {path}: HTTP {response.status}: {text}")
        return response


def drive(url: str, work: list[tuple[list[int], int]], api_key: str | None = None) -> dict:
    """Send every request of `work` at once, streaming; throughput and latencies as the in-process row."""
    client = _Client(url, api_key)
    try:
        model = json.loads(client.request("GET", "/v1/models").read())["data"][0]["id"]
    except OSError as e:
        raise ValueError(f"--url {url}: cannot reach the server ({e})") from None
    results: list[tuple[float, list[float], int] | BaseException] = [None] * len(work)
    start = threading.Barrier(len(work) + 1)

    def one(i: int, prompt: list[int], new: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            start.wait()
            sent = time.perf_counter()
            response = client.request("POST", "/v1/completions", body)
            times, tokens = [], 0
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    times.append(time.perf_counter())
            results[i] = (sent, times, tokens)
        except BaseException as e:      # noqa: BLE001 - reported once all clients are done
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, p, k)) for i, (p, k) in enumerate(work)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(work)} requests failed; the first: {failed[0]}")
    generated = sum(tokens for _, _, tokens in results)
    return dict(requests=len(work), prompt_tokens=sum(len(p) for p, _ in work), generated=generated, seconds=wall,
                tokens_per_s=generated / wall, **latencies([(sent, times) for sent, times, _ in results]))


def latencies(requests: list[tuple[float, list[float]]]) -> dict:
    """p50 and p99 time to first token and inter-token latency, in ms, of (start, token arrival times) pairs;
    the row's columns in `bench serve`, in process or over HTTP."""
    ttft = [times[0] - start for start, times in requests if times]
    itl = np.concatenate([np.diff(times) for _, times in requests if len(times) > 1] or [np.zeros(0)])
    return dict(ttft_p50_ms=_ms(ttft, 50), ttft_p99_ms=_ms(ttft, 99), itl_p50_ms=_ms(itl, 50), itl_p99_ms=_ms(itl, 99))


def _ms(values, q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if len(values) else 0.0
