"""bench serve --http URL: the same workloads sent to any OpenAI-compatible server.

Each request is a streamed POST /v1/completions with the prompt as token ids, max_tokens and
ignore_eos (vLLM's and cuinfer's extension; temperature 0), sent at its arrival time and held to at
most --concurrency in flight. Every streamed chunk is stamped as it arrives; the output token count
comes from the final usage chunk (stream_options.include_usage), so TPOT does not depend on how
the server groups tokens into chunks.
"""
from __future__ import annotations

import asyncio
import json
import time

from ..errors import CuinferError


async def _one(client, model, r, t0, sem, out_tokens):
    await asyncio.sleep(max(0.0, r.arrival - (time.perf_counter() - t0)))
    async with sem:
        body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_new, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "completions", json=body) as resp:  # under the base URL's /v1
            if resp.status_code != 200:
                raise CuinferError(f"the server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise CuinferError(f"the server ended a stream: {chunk['error'].get('message')}")
                if chunk.get("usage"):
                    out_tokens[id(r)] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a token's chunk (its text may be empty)
                    r.times.append(time.perf_counter() - t0)


async def _drive(url, model, requests, concurrency, api_key) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency or len(requests))
    out_tokens = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, model, r, t0, sem, out_tokens) for r in requests))
        wall = time.perf_counter() - t0
    for r in requests:
        r.n_out = out_tokens.get(id(r))
    return {"wall_s": wall, "out_tok": sum(r.n_out or len(r.times) for r in requests),
            "prompt_tok": sum(len(r.prompt) for r in requests), "peak_kv": float("nan"), "hit_rate": float("nan"),
            "preemptions": float("nan")}


def drive_http(url, model, requests, concurrency=0, api_key=None) -> dict:
    """Run the requests against the server at `url` (its address, /v1 added if missing); the totals.
    A server that cannot be reached, or drops a connection, ends the run with one message."""
    try:
        import httpx
    except ImportError:
        raise CuinferError("bench serve --http needs httpx: pip install httpx") from None

    base = url.rstrip("/")
    try:
        return asyncio.run(_drive(base if base.endswith("/v1") else base + "/v1", model, requests, concurrency, api_key))
    except httpx.HTTPError as e:
        raise CuinferError(f"--http {url}: {type(e).__name__}: {e}") from None
