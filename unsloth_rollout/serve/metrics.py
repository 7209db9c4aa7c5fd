"""``/metrics``: Prometheus text with vLLM's metric names, so a vLLM dashboard reads this server unchanged.

Per-request latencies are observed when a sample finishes (from ``GenerationOutput.metrics``): time to first
token, end-to-end, queue (arrival to first admission), prefill / decode split, the inter-token latency (one
observation per output token after the first: the time since the sample's previous token, as vLLM's) and each
sample's mean time per output token. ``vllm:iteration_tokens_total`` is observed by the engine after every step; prefix-cache queries and
hits count prompt tokens, as vLLM's do. ``vllm:kv_cache_usage_perc`` counts the blocks requests hold (blocks
only the prefix cache holds are reusable, as in vLLM: an idle server reports 0).

Example::

    curl -s localhost:8000/metrics | grep vllm:time_to_first_token_seconds_count
"""

from __future__ import annotations

import bisect
import threading
import time

# vLLM's buckets for the latency histograms (seconds) and for token counts.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count); thread-safe."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        i = next((j for j, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        with self._lock:
            self.counts[i] += times
            self.sum += value * times

    def observe_each(self, values) -> None:
        """One observation per value (under one lock)."""
        with self._lock:
            for v in values:
                self.counts[bisect.bisect_left(self.buckets, v)] += 1  # the first bucket with v <= le
                self.sum += v

    def lines(self, name: str, labels: str) -> list[str]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for b, c in zip(self.buckets + ("+Inf",), counts):
            acc += c
            le = b if isinstance(b, str) else float(b)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(acc)}')
        out += [f"{name}_sum{{{labels}}} {total}", f"{name}_count{{{labels}}} {float(acc)}"]
        return out


class ServerMetrics:
    """The histograms a server observes; ``observe_finished`` for each finished sample."""

    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": ("Time to first token.", _LATENCY_BUCKETS),
        "vllm:inter_token_latency_seconds": ("Time between consecutive output tokens (one per token).",
                                             _ITL_BUCKETS),
        "vllm:request_time_per_output_token_seconds": ("Mean time per output token (one per sample).", _ITL_BUCKETS),
        # vLLM keeps the old name as a deprecated alias of the inter-token latency.
        "vllm:time_per_output_token_seconds": ("DEPRECATED: use vllm:inter_token_latency_seconds.", _ITL_BUCKETS),
        "vllm:e2e_request_latency_seconds": ("End-to-end request latency.", _LATENCY_BUCKETS),
        "vllm:request_queue_time_seconds": ("Time in the waiting queue.", _LATENCY_BUCKETS),
        "vllm:request_inference_time_seconds": ("Time running (admission to finish).", _LATENCY_BUCKETS),
        "vllm:request_prefill_time_seconds": ("Admission to first token.", _LATENCY_BUCKETS),
        "vllm:request_decode_time_seconds": ("First token to finish.", _LATENCY_BUCKETS),
        "vllm:request_prompt_tokens": ("Prompt tokens per request.", _TOKEN_BUCKETS),
        "vllm:request_generation_tokens": ("Generated tokens per sample.", _TOKEN_BUCKETS),
        "vllm:iteration_tokens_total": ("Tokens computed per engine step.", _TOKEN_BUCKETS),
    }

    def __init__(self):
        self.hist = {name: Histogram(buckets) for name, (_, buckets) in self.HISTOGRAMS.items()}

    def observe_step(self, tokens: int) -> None:
        if tokens:
            self.hist["vllm:iteration_tokens_total"].observe(tokens)

    def observe_finished(self, out) -> None:
        m, h = out.metrics or {}, self.hist
        ttft, latency, queue = m.get("ttft_s"), m.get("latency_s"), m.get("queue_s")
        n = len(out.output_ids)
        h["vllm:request_generation_tokens"].observe(n)
        h["vllm:request_prompt_tokens"].observe(len(out.prompt_ids))
        if latency is not None:
            h["vllm:e2e_request_latency_seconds"].observe(latency)
        if queue is not None:
            h["vllm:request_queue_time_seconds"].observe(queue)
            if latency is not None:
                h["vllm:request_inference_time_seconds"].observe(latency - queue)
        if ttft is not None:
            h["vllm:time_to_first_token_seconds"].observe(ttft)
            if queue is not None:
                h["vllm:request_prefill_time_seconds"].observe(ttft - queue)
            if latency is not None:
                h["vllm:request_decode_time_seconds"].observe(latency - ttft)
                if n > 1:
                    h["vllm:request_time_per_output_token_seconds"].observe((latency - ttft) / (n - 1))
        gaps = m.get("inter_token_s") or ()
        h["vllm:inter_token_latency_seconds"].observe_each(gaps)
        h["vllm:time_per_output_token_seconds"].observe_each(gaps)


def _request_kv_usage(engine, stats: dict) -> float:
    """Fraction of KV blocks held by requests (running or preempted), not by the prefix cache alone."""
    return stats["kv_blocks_held_by_requests"] / max(1, stats["kv_blocks_total"])


def metrics_text(state) -> str:
    engine = state.engine
    s = engine.stats()
    c = state.counters
    label = f'model_name="{state.model_name}"'
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{labels}}} {float(value)}")

    def grouped(prefix, default, key_name):
        return [(f'{label},{key_name}="{k[1]}"', v) for k, v in sorted(c.items(), key=str)
                if isinstance(k, tuple) and k[0] == prefix] or [(f'{label},{key_name}="{default}"', 0)]

    metric("vllm:num_requests_running", "gauge", "Sequences decoding now.", [(label, s["num_running"])])
    metric("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", [(label, s["num_waiting"])])
    metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks requests hold (1 = full).",
           [(label, _request_kv_usage(engine, s))])
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens received.", [(label, c["prompt_tokens"])])
    metric("vllm:generation_tokens_total", "counter", "Tokens generated.", [(label, c["generation_tokens"])])
    metric("vllm:request_success_total", "counter", "Finished samples by finish reason.",
           grouped("finished", "stop", "finished_reason"))
    metric("vllm:num_preemptions_total", "counter", "Preemptions.", [(label, s.get("num_preemptions", 0))])
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [(label, s.get("prefix_cache_query_tokens", 0))])
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           [(label, s.get("prefix_cache_hit_tokens", 0))])
    cfg = engine.config
    info = (f'{label},block_size="{s["kv_block_size"]}",num_gpu_blocks="{s["kv_blocks_total"]}",'
            f'enable_prefix_caching="{cfg.prefix_cache}",cache_dtype="auto",num_cpu_blocks="0"')
    metric("vllm:cache_config_info", "gauge", "KV cache configuration.", [(info, 1)])
    for name, (help_, _) in ServerMetrics.HISTOGRAMS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        lines += state.metrics.hist[name].lines(name, label)
    metric("unsloth_rollout_http_requests_total", "counter", "Completion requests by endpoint.",
           grouped("requests", "chat", "endpoint"))
    metric("unsloth_rollout_http_errors_total", "counter", "Error responses by status code.",
           grouped("errors", "400", "status"))
    for key in ("steps", "prefill_tokens", "decode_tokens", "prefills", "requests", "finished", "aborted", "errors",
                "num_preemptions", "prefix_cache_hits", "prefix_cache_extensions", "prefix_cache_reused_tokens"):
        if key in s:
            metric(f"unsloth_rollout_engine_{key}_total", "counter", f"Engine counter {key}.", [(label, s[key])])
    for key in ("version", "paused", "kv_blocks_total", "kv_blocks_free", "kv_cache_bytes", "decode_workspace_bytes",
                "prefix_cache_entries", "max_model_len"):
        if key in s:
            metric(f"unsloth_rollout_engine_{key}", "gauge", f"Engine gauge {key}.", [(label, s[key])])
    metric("unsloth_rollout_uptime_seconds", "gauge", "Seconds since the app was built.",
           [(label, time.time() - state.start_time)])
    return "\n".join(lines) + "\n"
