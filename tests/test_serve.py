"""python -m cuinfer.serve in a subprocess on 127.0.0.1 (a tiny random checkpoint, the CPU backend),
driven with the official openai client and httpx: answers equal the engine's, streaming equals
non-streaming, concurrent clients equal sequential ones, a dropped stream frees its blocks, bad
input gets its 4xx and never a 500."""
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import make_tiny_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve"))


def start_server(ckpt, *args):
    """(process, URL) of python -m cuinfer.serve on a free port, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cuinfer.serve", str(ckpt), "--device", "cpu", "--port", str(port),
                             "--served-model-name", MODEL, "--kv-tokens", "8192", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health: {proc.stdout.read()}")


@pytest.fixture(scope="module")
def server(ckpt):
    proc, url = start_server(ckpt, "--api-key", KEY)
    yield url
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode is not None and "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    from cuinfer import Engine

    return Engine.from_pretrained(ckpt, device="cpu", kv_tokens=8192)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def streamed(client, content, **kw):
    pieces, usage = [], None
    for c in chat(client, content, stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage:
            usage = c.usage
        pieces += [ch.delta.content or "" for ch in c.choices]
    return "".join(pieces), usage


def test_chat_greedy_equals_the_engine_and_streaming_equals_not(client, engine):
    from cuinfer import SamplingParams

    r = chat(client, "Tell me about the sea.", max_tokens=12, temperature=0)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    want = engine.generate([ids], SamplingParams(max_new_tokens=12))[0]
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    text, usage = streamed(client, "Tell me about the sea.", max_tokens=12, temperature=0)
    assert text == want.text and usage.completion_tokens == len(want.token_ids)
    again = chat(client, "Tell me about the sea.", max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache kept its blocks


def test_logprobs_equal_the_engines_streamed_or_not(client, engine):
    from cuinfer import SamplingParams

    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a color."}])
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=5, logprobs=2))
    want = []
    while engine.has_unfinished_requests():
        want += [lp for o in engine.step() if o.request_id == rid for lp in o.new_logprobs]
    r = chat(client, "Name a color.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    got = r.choices[0].logprobs.content
    assert [round(c.logprob, 4) for c in got] == [round(lp, 4) for lp, _ in want]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in got)
    streamed_lps = [c.logprob for chunk in chat(client, "Name a color.", max_tokens=5, temperature=0, logprobs=True,
                                                top_logprobs=2, stream=True)
                    for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert streamed_lps == [c.logprob for c in got]
    comp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) == 3 for t in lp.top_logprobs)


def test_completions_prompts_n_seeds_and_stop(client):
    r = client.completions.create(model=MODEL, prompt=["hello there", "the sea"], max_tokens=6, n=2,
                                  temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt=["hello there", "the sea"], max_tokens=6, n=2,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    greedy = client.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2].strip())  # a visible one
    cut = client.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_completions_echo_the_prompt_streamed_or_not(client, engine):
    from cuinfer import SamplingParams
    plain = client.completions.create(model=MODEL, prompt="hello there", max_tokens=8, temperature=0)
    prompt_text = engine.tokenizer.decode(engine.encode("hello there"))
    echoed = client.completions.create(model=MODEL, prompt="hello there", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt_text + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0, echo=True, stream=True) if c.choices]
    assert pieces[0] == engine.tokenizer.decode([5, 6, 7])
    assert "".join(pieces[1:]) == client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8,
                                                            temperature=0).choices[0].text
    # with logprobs: the prompt's tokens first (the first has none), then the completion's
    ids = engine.encode("hello there")
    lp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4, temperature=0, echo=True,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    first = next(o for o in engine.step() if o.request_id == rid)
    while engine.has_unfinished_requests():
        engine.step()
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], [c for c, _ in first.prompt_logprobs[1:]], atol=1e-5)


def test_concurrent_streams_equal_sequential(server):
    prompts = [f"question number {i} about {w}" for i, w in enumerate(["cats", "ships", "rain", "maps"] * 4)]
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)

    async def one(p):
        text = ""
        async for c in await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                             max_tokens=8, temperature=0, stream=True):
            text += "".join(ch.delta.content or "" for ch in c.choices)
        return text

    async def both():
        together = await asyncio.gather(*(one(p) for p in prompts))
        return together, [await one(p) for p in prompts]

    together, alone = asyncio.run(both())
    assert together == alone


def metric(server, name):
    text = httpx.get(server + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_dropped_stream_frees_its_blocks(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(3):
            next(lines)
        assert metric(server, "cuinfer_requests_running") == 1
    for _ in range(100):
        if metric(server, "cuinfer_requests_running") == 0 and metric(server, "cuinfer_kv_cache_usage") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "cuinfer_requests_running") == 0 and metric(server, "cuinfer_kv_cache_usage") == 0


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, str):
        return httpx.post(server + path, content=body, headers={**headers, "content-type": "application/json"})
    return httpx.post(server + path, json=body, headers=headers)


@pytest.mark.parametrize("path, body, key, status, message", [
    ("/v1/completions", "{not json", KEY, 400, "not valid JSON"),
    ("/v1/completions", {"model": MODEL}, KEY, 400, "prompt: Field required"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": "hot"}, KEY, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, KEY, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 10 ** 6}, KEY, 400, "past the context"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 3000}, KEY, 400, "the context holds"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, KEY, 400, "non-empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "echo": True}, KEY, 400,
     "echo: a completions field"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, KEY, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "presence_penalty": 3}, KEY, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     KEY, 400, "needs logprobs"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, KEY, 404, "does not exist"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, KEY, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, KEY, 400, "role"),
    ("/v1/completions", {"model": MODEL, "prompt": "a"}, None, 401, "API key"),
    ("/v1/completions", {"model": MODEL, "prompt": "a"}, "wrong", 401, "API key"),
])
def test_bad_requests_get_their_status_and_openais_error_body(server, path, body, key, status, message):
    r = post(server, path, body, key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and set(err) == {"message", "type", "param", "code"}


scalars = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(scalars,
                           lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
                           max_leaves=6)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                          "seed", "stop", "n", "stream", "repetition_penalty", "ignore_eos", "logprobs"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(fields, json_values, max_size=6), st.booleans())
def test_fuzzed_bodies_never_give_a_500(server, body, chat_path):
    body = {"model": MODEL, "max_tokens": 2, **body} if body.get("model") is None else body
    path = "/v1/chat/completions" if chat_path else "/v1/completions"
    r = httpx.post(server + path, content=json.dumps(body, allow_nan=True),
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, r.text
    assert httpx.get(server + "/health").status_code == 200


def test_bench_serve_http_drives_the_server(server, tmp_path):
    """The load generator against this server: every request answered, usage-based token counts."""
    from cuinfer import bench

    out = tmp_path / "http.json"
    assert bench.main(["serve", "--http", server, "--model", MODEL, "--api-key", KEY, "--workload", "mixed",
                       "--scale", "0.01", "--vocab", "200", "--concurrency", "3", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert r["requests"] == 5 and r["out_tok_s"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "argument --port: got '99999', need an integer in 0..65535"),
    (["--max-waiting", "0"], "argument --max-waiting: got '0', need an integer >= 1"),
    (["--max-num-seqs", "-1"], "argument --max-num-seqs: got '-1'"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid:"),
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
    (["--dtype", "float16"], "--dtype float16: the CPU backend runs float32"),
])
def test_bad_server_flags_exit_2_before_loading(ckpt, flags, message):
    """A bad flag, an unknown host, a port in use or a dtype the device does not run: one message and
    exit 2, before the model loads."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags = [str(busy.getsockname()[1]) if f == "BUSY" else f for f in flags]
        r = subprocess.run([sys.executable, "-m", "cuinfer.serve", str(ckpt), "--device", "cpu", *flags],
                           check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "cuinfer serving" not in r.stderr

def test_sigterm_ends_running_streams_with_an_error_event(ckpt):
    proc, url = start_server(ckpt)
    try:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.terminate()
            rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line and "shutting down" in line for line in rest), rest[-3:]
        proc.wait(timeout=15)
    finally:
        proc.kill()
    assert "Traceback" not in proc.stdout.read()


def test_a_full_queue_answers_503_with_retry_after(ckpt):
    proc, url = start_server(ckpt, "--max-num-seqs", "1", "--max-waiting", "1")
    body = {"model": MODEL, "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        def hold():  # a stream that runs (or waits) until the server is killed
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        for _ in range(2):
            threading.Thread(target=hold, daemon=True).start()
        for _ in range(200):
            if metric(url, "cuinfer_requests_running") == 1 and metric(url, "cuinfer_requests_waiting") == 1:
                break
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "capacity" in r.text
    finally:
        proc.kill()


def test_speculative_server_gives_the_engines_greedy_text(ckpt, engine):
    """--speculative ngram: the same greedy text as the plain engine, streamed or not, and the drafts
    in /metrics."""
    from cuinfer import SamplingParams

    proc, url = start_server(ckpt, "--speculative", "ngram", "--num-speculative-tokens", "3")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        content = "Repeat: red fox, blue fox, red fox, blue fox, red fox, blue fox."
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
        want = engine.generate([ids], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
        r = chat(client, content, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == 32
        text, _ = streamed(client, content, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        assert text == want.text
        assert metric(url, "cuinfer_spec_draft_tokens") > 0
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out
