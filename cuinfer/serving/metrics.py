"""The server's Prometheus metrics (prometheus-client, the serve extra), in a registry of their own."""
import time


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, aengine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        for name, key, doc in (("running", "running", "requests in the running batch"),
                               ("waiting", "waiting", "requests waiting for admission"),
                               ("kv_cache_usage", "kv_cache_usage", "fraction of KV blocks held by requests"),
                               ("spec_draft_tokens", "draft_tokens", "speculative draft tokens verified"),
                               ("spec_accepted_tokens", "accepted_tokens", "speculative draft tokens accepted")):
            gauge = Gauge(f"cuinfer_requests_{name}" if key in ("running", "waiting") else f"cuinfer_{name}", doc,
                          registry=r)
            gauge.set_function(lambda key=key: aengine.stats()[key])
        self.prompt_tokens = Counter("cuinfer_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("cuinfer_generation_tokens", "generated tokens", registry=r)
        self.cache_hits = Counter("cuinfer_prefix_cache_hit_tokens", "prompt tokens from the prefix cache",
                                  registry=r)
        self.ttft = Histogram("cuinfer_time_to_first_token_seconds", "time to first token", registry=r)
        self.tpot = Histogram("cuinfer_time_per_output_token_seconds", "time per output token after the first",
                              registry=r)
        self.e2e = Histogram("cuinfer_e2e_request_latency_seconds", "request latency", registry=r)

    def finished(self, out, started: float):
        now = time.perf_counter()
        self.prompt_tokens.inc(len(out.prompt_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.cache_hits.inc(out.num_cached_tokens)
        self.ttft.observe(out.ttft_s)
        self.e2e.observe(now - started)
        if len(out.token_ids) > 1:
            self.tpot.observe((now - started - out.ttft_s) / (len(out.token_ids) - 1))
