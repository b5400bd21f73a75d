"""Prometheus text for /metrics: requests by status, tokens, time to first token and inter-token
histograms, counted in the HTTP process; running and waiting requests and KV-cache use, gauges the engine's
side reports (`engine_gauges`, read without the engine's lock: a step half done, never a wrong total for long)."""
from __future__ import annotations

import bisect
from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += n
        self.sum += value * n
        self.count += n

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()     # (endpoint, HTTP status)
        self.finished: Counter[str] = Counter()                 # by finish reason
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        self.requests[endpoint, status] += 1

    def tokens(self, seconds: float, n: int, first: bool) -> None:
        """n tokens arrived `seconds` after the request (first) or its previous tokens."""
        self.generation_tokens += n
        if first:
            self.ttft.observe(seconds)
            n -= 1
        if n > 0:
            self.itl.observe(seconds / n, n)

    def render(self, gauges: dict[str, float]) -> str:
        lines = ["# TYPE dsv4rt_requests_total counter"]
        lines += [f'dsv4rt_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
        lines.append("# TYPE dsv4rt_requests_finished_total counter")
        lines += [f'dsv4rt_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        lines += ["# TYPE dsv4rt_prompt_tokens_total counter", f"dsv4rt_prompt_tokens_total {self.prompt_tokens}",
                  "# TYPE dsv4rt_generation_tokens_total counter",
                  f"dsv4rt_generation_tokens_total {self.generation_tokens}",
                  "# TYPE dsv4rt_time_to_first_token_seconds histogram",
                  *self.ttft.lines("dsv4rt_time_to_first_token_seconds"),
                  "# TYPE dsv4rt_inter_token_latency_seconds histogram",
                  *self.itl.lines("dsv4rt_inter_token_latency_seconds")]
        for name, value in gauges.items():
            lines += [f"# TYPE dsv4rt_{name} gauge", f"dsv4rt_{name} {value}"]
        return "\n".join(lines) + "\n"


def engine_gauges(engine, waiting: int) -> dict[str, float]:
    """The gauges of /metrics, by name after `dsv4rt_`: running and `waiting` requests, KV-cache use."""
    a = engine.scheduler.blocks.allocator
    pages = [a.stats(c).used_pages for c in range(len(a.page_bytes))]
    return {"requests_running": len(engine.scheduler.running), "requests_waiting": waiting,
            "kv_cache_used_pages": sum(pages), "kv_cache_used_bytes": sum(n * b for n, b in zip(pages, a.page_bytes)),
            "kv_cache_total_bytes": a.total_bytes,
            "kv_cache_usage_ratio": 1 - a.free_slabs / a.n_slabs if a.n_slabs else 0.0}
