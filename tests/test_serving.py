"""The engine as a service, on the NumPy backend: online requests and abort, prefix caching (greedy
outputs equal those without it, across preemption, abort and pipelined decode), stream cleanup,
one or many prompts and params."""
import numpy as np
import pytest
from test_engine import CharTokenizer, NumpyDecoder, make_engine, small_config
from test_model import random_tensors

from cuinfer import Engine, SamplingParams
from cuinfer.errors import CuinferError
from cuinfer.model.decoder import Model


@pytest.fixture(scope="module")
def cpu_model():
    cfg = small_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=3), "cpu")


def shared_prefix_prompts(n, seed=0, vocab=97):
    """n prompts: one of three system prompts (33, 64 and 100 tokens: a partial block, exact blocks)
    then a question of 1-40 tokens; some prompts repeat exactly."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, k).tolist() for k in (33, 64, 100)]
    out = [systems[i % 3] + rng.integers(0, vocab, int(rng.integers(1, 41))).tolist() for i in range(n)]
    return out + out[:3]


def run_online(eng, prompts, params, abort_at=None):
    """Requests arriving over the first steps (two a step), some aborted mid-way: {index: token ids}
    of those that finished."""
    pending = list(enumerate(prompts))
    ids, done, steps = {}, {}, 0
    while pending or eng.has_unfinished_requests():
        for i, p in pending[:2]:
            ids[eng.add_request(p, params)] = i
        pending = pending[2:]
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = list(out.token_ids)
        steps += 1
        for rid, i in list(ids.items()):
            if abort_at and abort_at.get(i) == steps:
                eng.abort_request(rid)
    assert eng.kv_cache_usage() == 0.0
    return done


@pytest.mark.parametrize("pipelined", [False, True])
def test_prefix_caching_gives_the_same_greedy_tokens(cpu_model, pipelined):
    prompts = shared_prefix_prompts(14)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    abort_at = {3: 4, 9: 12}
    kw = dict(decoder=NumpyDecoder, async_decode=True) if pipelined else {}
    runs = {}
    for caching in (True, False):
        eng = make_engine(cpu_model, 768, max_batch_tokens=96, enable_prefix_caching=caching, **kw)  # preempts
        runs[caching] = run_online(eng, prompts, params, abort_at)
        assert eng.scheduler.num_preemptions > 0
        if caching:
            assert eng.scheduler.num_restored_tokens > 0
            assert eng.blocks.hit_tokens >= 4 * 64, "the shared system prompts were meant to hit"
            assert not pipelined or eng.stats.pipelined_steps > 0
    assert runs[True] == runs[False]
    assert 3 not in runs[True] and 9 not in runs[True] and len(runs[True]) == len(prompts) - 2


def test_cached_tokens_are_reported(cpu_model):
    eng = make_engine(cpu_model, 2048)
    system = list(range(40))
    first = eng.generate(system + [1, 2, 3], SamplingParams(max_new_tokens=4))[0]
    assert first.num_cached_tokens == 0
    second = eng.generate([system + [4, 5], system + [1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert [o.num_cached_tokens for o in second] == [32, 32]  # the two full blocks of 16 before token 42
    assert second[1].token_ids == first.token_ids
    assert eng.stats.cached_tokens == 64
    off = make_engine(cpu_model, 2048, enable_prefix_caching=False)
    off.generate(system + [1, 2, 3], SamplingParams(max_new_tokens=4))
    assert off.generate(system + [1, 2, 3], SamplingParams(max_new_tokens=4))[0].num_cached_tokens == 0


def test_add_request_between_steps_and_abort_frees_at_once(cpu_model):
    eng = make_engine(cpu_model, 1024)
    a = eng.add_request([1, 2, 3] * 20, SamplingParams(max_new_tokens=30))
    eng.step()
    held = eng.kv_cache_usage()
    assert held > 0
    b = eng.add_request([4, 5, 6], SamplingParams(max_new_tokens=3))
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {a, b}
    eng.abort_request(a)
    assert eng.kv_cache_usage() < held
    finished = {}
    while eng.has_unfinished_requests():
        finished.update((o.request_id, o) for o in eng.step() if o.finished)
    assert set(finished) == {b} and finished[b].finish_reason == "length"
    assert eng.kv_cache_usage() == 0.0
    eng.abort_request(a)  # unknown or finished ids are ignored
    eng.abort_request("nope")
    with pytest.raises(CuinferError, match="in use"):
        eng.add_request([1], request_id="x") and eng.add_request([1], request_id="x")


def test_an_abandoned_stream_cleans_up(cpu_model):
    eng = make_engine(cpu_model, 2048, tokenizer=CharTokenizer())
    want = eng.generate(["hello", "world"], SamplingParams(max_new_tokens=12))
    it = eng.stream(["abcdef", "ghijk", "lmn"], SamplingParams(max_new_tokens=50))
    next(it)
    it.close()
    assert not eng.has_unfinished_requests() and eng.kv_cache_usage() == 0.0
    got = eng.generate(["hello", "world"], SamplingParams(max_new_tokens=12))
    assert [o.text for o in got] == [o.text for o in want]


def test_one_prompt_or_many_with_their_own_params(cpu_model):
    eng = make_engine(cpu_model, 2048, tokenizer=CharTokenizer())
    one = eng.generate("hello", SamplingParams(max_new_tokens=5))
    assert len(one) == 1 and len(one[0].token_ids) == 5
    assert eng.generate([3, 4, 5], SamplingParams(max_new_tokens=2))[0].prompt_ids == [3, 4, 5]
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=7, temperature=1.0, seed=1)]
    mixed = eng.generate(["hello", "abc"], params)
    assert [len(o.token_ids) for o in mixed] == [3, 7]
    assert mixed[0].token_ids == one[0].token_ids[:3]
    assert mixed[1].token_ids == eng.generate("abc", params[1])[0].token_ids
    with pytest.raises(CuinferError, match="2 SamplingParams for 3 prompts"):
        eng.generate(["a", "b", "c"], params)


def test_public_entry():
    import cuinfer

    assert cuinfer.Engine is Engine and cuinfer.SamplingParams is SamplingParams


def test_bench_serve_drives_a_workload(cpu_model):
    """bench serve's loop on the NumPy engine: every token stamped, arrivals honoured, the row's
    numbers consistent (the GPU run is the benchmark; this checks its bookkeeping)."""
    from cuinfer.benches.serve import Request, drive, row, workload

    reqs = workload("shared-prefix", 97, scale=0.02)  # 5 requests
    assert len(reqs) == 5 and all(r.prompt[:2048] == reqs[0].prompt[:2048] for r in reqs)
    reqs = [Request(r.prompt[2000:], 6, 0.01 * i) for i, r in enumerate(reqs)]
    eng = make_engine(cpu_model, 4096)
    totals = drive(eng, reqs)
    assert [len(r.times) for r in reqs] == [6] * 5 and totals["out_tok"] == 30
    assert all(r.times[0] >= r.arrival for r in reqs)
    assert totals["hit_rate"] > 0 and totals["peak_kv"] > 0 and eng.kv_cache_usage() == 0.0
    assert 0 < totals["prefill_step_s"] and 0 < totals["decode_step_s"]
    assert totals["prefill_step_s"] + totals["decode_step_s"] <= totals["wall_s"]
    out = row("x", reqs, totals)
    assert out["ttft_p50_ms"] <= out["ttft_p99_ms"] and out["out_tok_s"] > 0
    assert out["prefill_step_s"] == totals["prefill_step_s"]


def test_logprobs_match_the_models_log_softmax_and_penalties_apply(cpu_model):
    from cuinfer.model.kv_cache import CacheShape, KVCache
    from cuinfer.model.step_inputs import Batch

    eng = make_engine(cpu_model, 2048)
    prompt = [5, 6, 7, 8, 9]
    plain = eng.generate(prompt, SamplingParams(max_new_tokens=6))[0]
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=6, logprobs=3))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == plain.token_ids and outs[-1].request_id == rid
    cfg = cpu_model.config
    cache = KVCache.allocate(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16),
                             np.float32, np, 256)
    seq = prompt + plain.token_ids
    logits = cpu_model.forward(Batch.from_chunks([(seq, 0, list(range(16)))], 16), cache, all_logits=True)
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    for j, o in enumerate(outs):
        (chosen, top), = o.new_logprobs
        pos = len(prompt) - 1 + j
        assert abs(chosen - ref[pos, plain.token_ids[j]]) < 1e-4
        assert [t for t, _ in top] == list(np.argsort(-ref[pos])[:3])
    penalised = eng.generate(prompt, SamplingParams(max_new_tokens=12, frequency_penalty=2.0))[0].token_ids
    free = eng.generate(prompt, SamplingParams(max_new_tokens=12))[0].token_ids
    assert penalised != free
    assert max(penalised.count(t) for t in penalised) <= max(free.count(t) for t in free)


@pytest.mark.parametrize("argv, message", [
    (["decode", "--batch", "1"], "python -m cuinfer.bench decode needs a CUDA GPU, and none was found"),
    (["spec"], "python -m cuinfer.bench spec needs a CUDA GPU"),
    (["serve", "--http", "http://127.0.0.1:9", "--model", "m", "--vocab", "50", "--workload", "rate",
      "--num-requests", "2"], "--http http://127.0.0.1:9: ConnectError"),
])
def test_bench_user_errors_exit_2_with_one_message(argv, message):
    """A GPU suite on a machine without a GPU, a server that cannot be reached: one line, exit 2."""
    import socket
    import subprocess
    import sys

    from conftest import HAS_GPU

    if HAS_GPU and argv[0] != "serve":
        pytest.skip("checks the message on a machine without a GPU")
    with socket.socket() as s:  # port 9 (discard) is closed here; make sure nothing listens on it
        if s.connect_ex(("127.0.0.1", 9)) == 0:
            pytest.skip("something listens on 127.0.0.1:9")
    r = subprocess.run([sys.executable, "-m", "cuinfer.bench", *argv], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
