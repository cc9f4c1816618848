"""Engine: continuous batching gives each request what it gets alone (preemption included), streams,
stops, seeds; pipelined decode (through NumpyDecoder, a numpy stand-in for DecodeGraph) equals the
synchronous engine; GPU batched-vs-alone on the same weights."""
import numpy as np
import pytest
from test_model import random_tensors, tiny_config

from cuinfer.errors import CuinferError
from cuinfer.model.decoder import Model
from cuinfer.model.kv_cache import CacheShape, KVCache
from cuinfer.model.step_inputs import input_views, pack_inputs
from cuinfer.ops import runtime
from cuinfer.ops.sampling import sampling as sampling_op
from cuinfer.serving.engine import Engine
from cuinfer.serving.request import PromptTooLongError
from cuinfer.serving.runner import MIN_CONTEXT_BUCKET, bucket
from cuinfer.serving.sampling import SamplingParams
from cuinfer.serving.scheduler import PENDING
from cuinfer.serving.warm_up import warm_up_rows


class CharTokenizer:
    """Token id t is the character chr(97 + t % 26); enough to test streaming and stop strings."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def stream(self):
        return type("S", (), {"push": staticmethod(lambda t: chr(97 + t % 26))})()


def small_config():
    """GQA 4:1 with a small head so 64 prompts of up to 1,500 tokens run in seconds on numpy."""
    return tiny_config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16)


def make_engine(model, kv_tokens, block_size=16, max_batch_tokens=512, tokenizer=None, eos=(), decoder=None, **kw):
    """decoder: a class taking (model, kv_cache, scratch block), e.g. NumpyDecoder; kw: Engine's other
    arguments."""
    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size)
    cache = KVCache.allocate(shape, model.dtype, model.xp, kv_tokens)
    return Engine(model, cache, tokenizer, eos, max_batch_tokens=max_batch_tokens,
                  decoder=(lambda scratch: decoder(model, cache, scratch)) if decoder else None, **kw)


@pytest.fixture(scope="module")
def cpu_model():
    cfg = small_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=3), "cpu")


def mixed_prompts(vocab, n=64, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[10, 1500, 16 * 3 - 1, 16 * 3 + 1], rng.integers(10, 1501, n - 4)])
    return [rng.integers(0, vocab, int(k)).tolist() for k in lengths]


def test_batch_with_preemption_equals_alone(cpu_model):
    prompts = mixed_prompts(cpu_model.config.vocab_size)
    params = SamplingParams(max_new_tokens=24)
    total = sum(len(p) + params.max_new_tokens for p in prompts)
    kv_tokens = 4096  # under a tenth of the batch's 48k tokens
    assert kv_tokens < total / 10
    eng = make_engine(cpu_model, kv_tokens)
    batched = eng.generate(prompts, params)
    assert eng.stats.preemptions > 0, "the budget was meant to force preemption"
    alone_engine = make_engine(cpu_model, 2048)
    for p, out in zip(prompts, batched):
        alone = alone_engine.generate([p], params)[0]
        assert out.token_ids == alone.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert eng.blocks.num_free == eng.blocks.num_blocks and eng.kv_cache_usage() == 0.0
    kv = eng.stats.kv
    assert kv["paged_bytes"] < kv["contiguous_bytes"] and 0 < kv["saving"] < 1


def test_chunked_prefill_does_not_stall_decodes(cpu_model):
    eng = make_engine(cpu_model, 4096, max_batch_tokens=64)
    short = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8))
    long_ = eng.add_request(list(range(90)) * 15, SamplingParams(max_new_tokens=1))
    finished = {}
    steps = 0
    while short not in finished:
        finished.update((o.request_id, o) for o in eng.step() if o.finished)
        steps += 1
    assert steps == 8 and long_ not in finished  # 8 decodes done while the 1,350 tokens prefill
    while eng.has_unfinished_requests():
        finished.update((o.request_id, o) for o in eng.step() if o.finished)
    assert finished[long_].finish_reason == "length"


def test_stream_stop_string_and_eos(cpu_model):
    tok = CharTokenizer()
    eng = make_engine(cpu_model, 2048, tokenizer=tok)
    prompts = ["hello", "abcabcabc", "zz"]
    full = eng.generate(prompts, SamplingParams(max_new_tokens=20))
    pieces = ["", "", ""]
    for i, new in eng.stream(prompts, SamplingParams(max_new_tokens=20)):
        pieces[i] += new
    assert pieces == [o.text for o in full]
    # stop at a string that the greedy text contains: text ends before it, never streamed past it
    text = full[0].text
    stop = text[5:7]
    cut = text.find(stop)
    streamed = "".join(new for _, new in eng.stream([prompts[0]], SamplingParams(max_new_tokens=20, stop=(stop,))))
    out = eng.outputs[0]
    assert out.text == text[:cut] == streamed and out.finish_reason == "stop"
    # an end token stops the sequence and is not in the text
    eos_id = full[1].token_ids[3]
    first = full[1].token_ids.index(eos_id)
    eng2 = make_engine(cpu_model, 2048, tokenizer=tok, eos=(eos_id,))
    out = eng2.generate([prompts[1]], SamplingParams(max_new_tokens=20))[0]
    assert out.token_ids == full[1].token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.text == full[1].text[:first]
    out = eng2.generate([prompts[1]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == full[1].token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(cpu_model):
    p = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    eng = make_engine(cpu_model, 4096)
    alone = eng.generate([[5, 6, 7]], p)[0].token_ids
    others = mixed_prompts(cpu_model.config.vocab_size, n=6, seed=9)
    batched = eng.generate(others[:3] + [[5, 6, 7]] + others[3:], p)[3].token_ids
    assert alone == batched
    unseeded = eng.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=10, temperature=1.0))
    assert unseeded[0].token_ids != unseeded[1].token_ids


def test_user_errors(cpu_model):
    eng = make_engine(cpu_model, 512)
    with pytest.raises(PromptTooLongError, match="prompt: 600 tokens, the context holds 512"):
        eng.generate([[1] * 600], SamplingParams())
    with pytest.raises(runtime.CuinferError, match="no tokenizer"):
        eng.generate(["text"], SamplingParams())
    with pytest.raises(runtime.CuinferError, match="empty"):
        eng.generate([[]], SamplingParams())
    out = eng.generate([[1] * 500], SamplingParams(max_new_tokens=100))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12  # the context (512) is full


# ------------------------------------------------- pipelined decode, on the CPU

class DeviceTokens:
    """A greedy step's tokens "on the device": the host may read them only through get() (the
    synchronous path) or NumpyDecoder.read_async(...).wait()."""

    def __init__(self, values, step):
        self._values, self.step = values, step

    def __len__(self):
        return len(self._values)

    def get(self):
        return self._values.copy()

    def __getitem__(self, rows):  # the engine gathers the rows a pipelined step keeps
        return DeviceTokens(self._values[rows], self.step)


class NumpyDecoder:
    """DecodeGraph's interface (run, read_async) on the numpy backend, so that the engine's
    pipelined decode runs on the CPU: run() computes the step at once, but its tokens (greedy, or
    sampled by ops.sampling's reference) reach the host only through read_async(...).wait(); token ids given without device_tokens must be
    real ones. log: ("run", step, rows, pipelined) and ("wait", step) in call order."""

    def __init__(self, model, kv_cache, scratch):
        self.model, self.kv_cache, self.scratch = model, kv_cache, scratch
        self.steps = {}  # DecodeGraph's captured steps: none here
        self.log = []
        self.rows = 0  # rows of greedy and sampled token steps computed
        self.sampled_rows = 0  # of those, rows of sampled steps

    def run(self, token_ids, positions, block_tables, greedy, device_tokens=None, sampling=None):
        bs, n = self.kv_cache.block_size, len(token_ids)
        b, width = bucket(n), bucket(max(positions) + 1, MIN_CONTEXT_BUCKET) // bs
        buf = np.zeros(b * (4 + width), dtype=np.int32)
        if device_tokens is None:
            assert min(token_ids) >= 0, f"a placeholder reached the decoder: {token_ids}"
        pack_inputs(buf, token_ids, positions, block_tables, bs, self.scratch, b, width)
        inputs = input_views(buf, b, width)
        if device_tokens is not None:
            assert len(device_tokens) == n
            inputs.token_ids[:n] = device_tokens._values
        out = self.model.decode(inputs, self.kv_cache, width * bs, greedy=greedy)[:n]
        if sampling is not None:  # DecodeGraph's "sample" step: ops.sampling on the logits
            out = sampling_op(out, *sampling)
            self.sampled_rows += n
        elif not greedy:
            return out
        step = sum(1 for e in self.log if e[0] == "run")
        self.log.append(("run", step, n, device_tokens is not None))
        self.rows += n
        return DeviceTokens(out, step)

    def graph_bytes(self):
        return 0

    def read_async(self, tokens):
        log = self.log

        class Pending:
            def wait(self):
                log.append(("wait", tokens.step))
                return tokens._values.tolist()

        return Pending()


def run_requests(eng, requests):
    """Add (prompt, params) requests and step the engine until done, checking after each step that
    PENDING is only ever the last token of a running sequence. (outputs, events, decode stats)."""
    ids = [eng.add_request(p, params) for p, params in requests]
    index = {rid: i for i, rid in enumerate(ids)}
    seqs = [eng._requests[rid].seq for rid in ids]
    events, final = [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            events.append((index[o.request_id], o.new_text, o.finished))
            if o.finished:
                final[o.request_id] = o
        for s in seqs:
            assert PENDING not in s.output_ids[:-1]
            assert s.finish_reason is None or PENDING not in s.output_ids
    assert eng._inflight is None
    outs = [(s.output_ids, final[rid].text, s.finish_reason) for rid, s in zip(ids, seqs)]
    st = eng.stats
    return outs, events, (st.generated_tokens, st.decode_tokens, st.prefill_tokens, st.preemptions)


def pipelined_and_not(model, requests, **kw):
    """run_requests on the same engine set-up with and without pipelining: the pipelined engine,
    and the two results (which the tests want equal)."""
    results = []
    for async_decode in (True, False):
        eng = make_engine(model, decoder=NumpyDecoder, async_decode=async_decode, **kw)
        results.append(run_requests(eng, requests))
        assert eng.blocks.num_free == eng.blocks.num_blocks == eng.kv_cache.num_blocks - 1  # not the scratch block
        if async_decode:
            pipelined = eng
        else:
            assert eng.stats.pipelined_steps == 0
    return pipelined, results[0], results[1]


def stop_requests(model):
    """Greedy requests of different lengths and max_new_tokens, stopped by the end token, a stop id
    and a stop string each picked mid-way from an unstopped run, one ignoring the end token; the eos
    token for the engine."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(4)
    ids = [rng.integers(0, vocab, n).tolist() for n in (3, 17, 40, 5, 60, 9, 33)]
    news = [30, 7, 25, 40, 12, 33, 20]
    plain = make_engine(model, 4096, tokenizer=CharTokenizer(), decoder=NumpyDecoder, async_decode=False)
    free = [o.token_ids for o in plain.generate(ids, SamplingParams(max_new_tokens=40))]
    text = plain.outputs[2].text
    eos = free[0][6]
    reqs = [SamplingParams(max_new_tokens=n) for n in news]
    reqs[1] = SamplingParams(max_new_tokens=news[1], ignore_eos=True)
    reqs[3] = SamplingParams(max_new_tokens=news[3], stop_token_ids=(free[3][11],))
    reqs[2] = SamplingParams(max_new_tokens=news[2], stop=(text[9:11],))
    return list(zip(ids, reqs)), eos


def test_pipelined_decode_equals_synchronous_with_stops(cpu_model):
    """End token, stop id, stop string, max_new_tokens, different lengths: the same tokens, texts,
    finish reasons, streamed events (in order) and token counts as without pipelining; the steps
    really were pipelined and the extra tokens computed after a data-dependent stop were dropped."""
    requests, eos = stop_requests(cpu_model)
    eng, got, want = pipelined_and_not(cpu_model, requests, kv_tokens=4096, tokenizer=CharTokenizer(), eos=(eos,))
    assert got == want
    reasons = [r for _, _, r in got[0]]
    assert reasons.count("stop") >= 3 and "length" in reasons, reasons
    assert eng.stats.pipelined_steps > 10
    wasted = eng.decoder.rows - eng.stats.decode_tokens
    assert 1 <= wasted <= reasons.count("stop")  # only data-dependent stops waste, one token at most


def test_pipelined_decode_wastes_nothing_on_known_stops(cpu_model):
    """max_new_tokens and the context length are known in advance: no row is computed that is not
    emitted. The context limit (kv_tokens 256: 240 tokens without the scratch block) ends one."""
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 97, n).tolist() for n in (3, 17, 225, 8)]
    requests = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ids, (9, 4, 40, 1))]
    eng, got, want = pipelined_and_not(cpu_model, requests, kv_tokens=256)
    assert got == want
    assert len(got[0][2][0]) == 240 - 225 and [len(o) for o, _, _ in got[0]] == [9, 4, 15, 1]
    assert eng.stats.pipelined_steps > 0 and eng.stats.preemptions == 0
    assert eng.decoder.rows == eng.stats.decode_tokens


def test_pipelined_decode_goes_on_past_a_length_finish(cpu_model):
    """Nothing waiting: a sequence whose pending token is its last (max_new_tokens) gets no row in
    the step pipelined after it, and the others' tokens are gathered on the device, so every decode
    step after the first is launched before the previous one is read, the batch shrinking 3, 2, 1;
    the outputs equal the synchronous engine's and no row is wasted."""
    rng = np.random.default_rng(6)
    ids = [rng.integers(0, 97, n).tolist() for n in (4, 9, 6)]
    requests = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ids, (3, 7, 5))]
    eng, got, want = pipelined_and_not(cpu_model, requests, kv_tokens=1024)
    assert got == want
    runs = [e for e in eng.decoder.log if e[0] == "run"]
    assert [pipelined for *_, pipelined in runs] == [False] + [True] * (len(runs) - 1)
    assert [rows for _, _, rows, _ in runs] == [3, 3, 2, 2, 1, 1]
    assert eng.decoder.rows == eng.stats.decode_tokens


def test_pipelined_decode_launches_before_reading():
    """One sequence, 6 new tokens (the first from the prefill): each decode step after the first is
    launched before the previous step's tokens are waited for, and no step runs past the last."""
    cfg = small_config()
    model = Model.from_tensors(cfg, random_tensors(cfg, seed=3), "cpu")
    eng = make_engine(model, 1024, decoder=NumpyDecoder, async_decode=True)
    out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    assert eng.decoder.log == [("run", 0, 1, False), ("run", 1, 1, True), ("wait", 0), ("run", 2, 1, True),
                               ("wait", 1), ("run", 3, 1, True), ("wait", 2), ("run", 4, 1, True), ("wait", 3),
                               ("wait", 4)]
    assert eng.stats.pipelined_steps == 4 and eng.stats.decode_tokens == 5


def test_pipelined_decode_drops_the_extra_token_after_an_end_token(cpu_model):
    """A lone sequence stopped by an end token mid-way: the step pipelined after it ran (one extra
    row), its token is neither appended nor emitted, and it is not left in flight."""
    plain = make_engine(cpu_model, 1024, decoder=NumpyDecoder, async_decode=False)
    free = plain.generate([[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=12))[0].token_ids
    eos = free[7]
    first = free.index(eos)
    assert first > 2
    eng = make_engine(cpu_model, 1024, decoder=NumpyDecoder, eos=(eos,), async_decode=True)
    seq = eng._requests[eng.add_request([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=12))].seq
    while seq.finish_reason is None:
        eng.step()
    assert eng._inflight is None and not eng.scheduler.has_work()
    assert seq.output_ids == free[:first + 1] and seq.finish_reason == "stop"
    assert eng.decoder.log[-3:] == [("run", first, 1, True), ("wait", first - 1), ("wait", first)]
    assert eng.decoder.rows == eng.stats.decode_tokens + 1 == first + 1
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_pipelined_decode_with_a_queue_and_preemption(cpu_model):
    """More requests than max_num_seqs (a queue), a cache small enough to preempt, stops on data
    and not: the same results as without pipelining."""
    rng = np.random.default_rng(6)
    ids = [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(5, 120, 12)]
    requests = [(p, SamplingParams(max_new_tokens=int(n), ignore_eos=bool(i % 2)))
                for i, (p, n) in enumerate(zip(ids, rng.integers(5, 60, 12)))]
    first = make_engine(cpu_model, 4096, decoder=NumpyDecoder).generate([p for p, _ in requests],
                                                                       SamplingParams(max_new_tokens=60))
    eos = first[0].token_ids[3]
    for kv_tokens, max_num_seqs in ((4096, 3), (640, 256)):
        eng, got, want = pipelined_and_not(cpu_model, requests, kv_tokens=kv_tokens, eos=(eos,),
                                           max_num_seqs=max_num_seqs)
        assert got == want
        assert eng.stats.pipelined_steps > 0
        if kv_tokens == 640:
            assert eng.stats.preemptions > 0
        assert any(r == "stop" for _, _, r in got[0]), "the end token was meant to stop some"


def test_pipelined_decode_with_sampling_and_penalties(cpu_model):
    """Repetition-penalised sequences never pipeline (their steps read logits); greedy and plainly
    sampled ones do once they run without them: the same tokens as without pipelining."""
    ids = [[5, 6, 7], [8, 9, 10, 11], [12] * 20]
    requests = [(ids[0], SamplingParams(max_new_tokens=8, temperature=0.9, seed=3)),
                (ids[1], SamplingParams(max_new_tokens=12, repetition_penalty=1.3)),
                (ids[2], SamplingParams(max_new_tokens=30))]
    eng, got, want = pipelined_and_not(cpu_model, requests, kv_tokens=2048)
    assert got == want
    assert eng.stats.pipelined_steps > 0


def test_decoder_sampled_steps_are_seeded_and_batch_independent(cpu_model):
    """Decode steps whose rows are greedy or plainly sampled end in ops.sampling on the decoder
    (DecodeGraph's "sample" step; here NumpyDecoder): a seeded request gets the same tokens alone
    and beside greedy, sampled and penalised requests (those steps go through the logits and the
    eager sampler), pipelined or not, and the decoder drew them."""
    rng = np.random.default_rng(21)
    vocab = cpu_model.config.vocab_size
    prompt = [5, 6, 7]
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=1234, ignore_eos=True)
    others = [(rng.integers(0, vocab, int(n)).tolist(), q) for n, q in zip(
        (4, 30, 9, 17), (SamplingParams(max_new_tokens=15), SamplingParams(max_new_tokens=6, temperature=0.7, seed=5),
                         SamplingParams(max_new_tokens=9, temperature=2.0, top_k=5, seed=8),
                         SamplingParams(max_new_tokens=5, temperature=0.9, repetition_penalty=1.2, seed=7)))]
    runs = []
    for async_decode in (False, True):
        eng = make_engine(cpu_model, 4096, decoder=NumpyDecoder, async_decode=async_decode)
        alone = eng.generate([prompt], p)[0].token_ids
        alone_rows = eng.decoder.sampled_rows
        batched = eng.generate([q for q, _ in others[:2]] + [prompt] + [q for q, _ in others[2:]],
                               [sp for _, sp in others[:2]] + [p] + [sp for _, sp in others[2:]])
        assert batched[2].token_ids == alone and len(alone) == 12
        assert alone_rows >= 11 and eng.decoder.sampled_rows > alone_rows + 11
        runs.append([o.token_ids for o in batched])
        if async_decode:
            assert eng.stats.pipelined_steps > 0
    assert runs[0] == runs[1]
    again = make_engine(cpu_model, 4096, decoder=NumpyDecoder).generate([prompt], SamplingParams(
        max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=1235, ignore_eos=True))
    assert again[0].token_ids != alone  # another seed, other tokens


def test_pipelined_stream_equals_synchronous(cpu_model):
    """stream() through the pipelined engine: the same pieces, outputs and stats counts, and nothing
    left in flight between calls."""
    prompts = ["hello", "abcabcabc", "zz"]
    params = SamplingParams(max_new_tokens=20, stop=("q",))
    runs = []
    for async_decode in (True, False):
        eng = make_engine(cpu_model, 2048, tokenizer=CharTokenizer(), decoder=NumpyDecoder, async_decode=async_decode)
        eos = eng.generate(prompts, params)[1].token_ids[5]
        eng.eos_token_ids = frozenset([eos])
        pieces = list(eng.stream(prompts, params))
        assert eng._inflight is None
        runs.append((pieces, [(o.token_ids, o.text, o.finish_reason) for o in eng.outputs],
                     eng.stats.decode_tokens, eng.stats.generated_tokens))
    assert runs[0] == runs[1]


def test_warm_up_runs_every_step_kind_and_leaves_the_engine_as_new(cpu_model):
    """warm_up runs a forward of every row count warm_up_rows names and a mixed step, a decode of
    every batch bucket up to max_num_seqs and requests through step(); then the engine is as new:
    every block free and uncached, no stats, the same outputs as an engine that never warmed up."""
    rows, mixed = [], []
    forward = cpu_model.forward

    def counting(batch, kv_cache, all_logits=False):
        rows.append(len(batch.token_ids))
        mixed.append(0 < batch.decodes < len(batch.token_ids))
        return forward(batch, kv_cache, all_logits)

    prompts = mixed_prompts(cpu_model.config.vocab_size, n=12, seed=5)
    params = SamplingParams(max_new_tokens=6)
    eng = make_engine(cpu_model, 2048, max_batch_tokens=100, decoder=NumpyDecoder, max_num_seqs=20)
    cpu_model.forward = counting
    try:
        report = eng.warm_up()
    finally:
        del cpu_model.forward
    assert report["graphs"] == 0 and report["seconds"] > 0
    assert set(warm_up_rows(100)) <= set(rows) and any(mixed)
    assert warm_up_rows(100)[-1] == 100 and len(set(warm_up_rows(100))) == len(warm_up_rows(100))
    decoded = [e[2] for e in eng.decoder.log if e[0] == "run"]
    assert {1, 2, 4, 8, 16, 24} <= set(decoded)  # every bucket up to batch_bucket(20)
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.blocks._block_of
    assert eng.stats.prompt_tokens == 0 and eng.stats.generated_tokens == 0
    assert eng.add_request([1, 2, 3], params) == "0"  # warm-up's requests took no id
    with pytest.raises(CuinferError, match="before the first request"):
        eng.warm_up()
    eng.abort_request("0")
    outs = eng.generate(prompts, params)
    fresh = make_engine(cpu_model, 2048, max_batch_tokens=100, decoder=NumpyDecoder, max_num_seqs=20)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh.generate(prompts, params)]
    assert eng.blocks.hit_tokens == fresh.blocks.hit_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, runtime.bfloat16])
def test_gpu_batch_equals_alone_same_composition(dtype):
    """The GPU attention kernels have no fp32 form, and fp16/bf16 results depend on the batch
    shape (different GEMM tiles, different rounding), so exact batched-vs-alone identity is only
    asserted on the numpy backend above. Here, with recompute after preemption (no prefix cache):
    the 64-prompt batch under a budget that forces preemption gives the same tokens on two runs
    with the same composition (recompute is deterministic), and >= 90% of its outputs equal a run
    with room for everything (no preemption); a greedy flip on a near-tie after a rounding
    difference is the only way they may differ. With the prefix cache a preempted sequence takes
    back its cached blocks instead of recomputing them: its outputs agree with the float32 NumPy
    engine at least as often as the roomy run's do."""
    cfg = tiny_config(num_hidden_layers=2)
    model = Model.from_tensors(cfg, random_tensors(cfg, seed=3), "gpu", dtype)
    prompts = mixed_prompts(cfg.vocab_size)
    params = SamplingParams(max_new_tokens=16)
    eng = make_engine(model, 4096, enable_prefix_caching=False)
    first = eng.generate(prompts, params)
    assert eng.stats.preemptions > 0
    second = make_engine(model, 4096, enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    roomy = make_engine(model, 131072).generate(prompts, params)  # no preemption at all
    same = np.mean([a.token_ids == b.token_ids for a, b in zip(first, roomy)])
    assert same >= 0.9, f"only {same:.0%} of outputs agree with and without preemption"

    cached_eng = make_engine(model, 4096)
    cached = cached_eng.generate(prompts, params)
    assert cached_eng.stats.preemptions > 0 and cached_eng.scheduler.num_restored_tokens > 0
    cpu = Model.from_tensors(cfg, random_tensors(cfg, seed=3), "cpu")
    ref = make_engine(cpu, 131072).generate(prompts, params)
    agree = lambda outs: np.mean([a.token_ids == b.token_ids for a, b in zip(outs, ref)])  # noqa: E731
    assert agree(cached) >= agree(roomy), (agree(cached), agree(roomy))


# ------------------------------------------------- against Hugging Face transformers (CPU)

HF_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
HF_CHATS = ["What is 2 + 2?", "Write a haiku about the sea.", "Name three primary colors."]


def checkpoint_dir(name, tmp_path_factory):
    if name == "default":
        from cuinfer.io.default_model import default_model_dir

        try:
            return default_model_dir()
        except (runtime.CuinferError, ModuleNotFoundError) as e:
            pytest.skip(f"default model not available here: {e}")
    from helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), preset=name)


@pytest.mark.parametrize("name", ["default", "tiny", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma2"])
def test_greedy_matches_transformers(name, tmp_path_factory):
    """48 greedy tokens per prompt (plain and chat-templated, batched together) equal transformers'
    (eager attention) greedy generate token for token; prefill logits agree within 1e-4 of their
    largest magnitude. The tiny Qwen3, Phi-3 and Gemma 2 have windows of 32 (on one layer, every
    layer, alternate layers), shorter than prompt and continuation."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from cuinfer.model.step_inputs import Batch

    path = checkpoint_dir(name, tmp_path_factory)
    eng = Engine.from_pretrained(path, device="cpu", kv_tokens=8192)
    tok = eng.tokenizer
    prompts = [tok.encode(p) for p in HF_PROMPTS]
    if tok.chat_template is not None:
        prompts += [tok.encode_chat([{"role": "user", "content": c}]) for c in HF_CHATS]
    ours = eng.generate(prompts, SamplingParams(max_new_tokens=48))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = eng.model.config
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            x = torch.tensor([ids])
            ref_logits = hf(x).logits[0].numpy()
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                              pad_token_id=cfg.bos_token_id or 0)[0, len(ids):].tolist()
        assert out.token_ids == gen, (tok.decode(out.token_ids), tok.decode(gen))
        cache = KVCache(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), 16,
                        np.float32)
        batch = Batch.from_chunks([(ids, 0, list(range(-(-len(ids) // 16))))], 16)
        logits = eng.model.forward(batch, cache, all_logits=True)
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-4, f"logits differ by {err:.2e} of their largest magnitude"


def released_window_case(device):
    """Every layer slides a 40-key window: a sequence stops holding its blocks wholly behind the
    window (and the kernels' read margin) as it grows, other sequences reuse them, and the tokens
    equal those of an engine that holds every block (in a cache roomy enough for that)."""
    from cuinfer.serving.scheduler import WINDOW_READ_MARGIN

    cfg = small_config().replace(sliding_window=40, layer_types=("sliding_attention",) * 2)
    if device == "gpu":
        cfg = cfg.replace(head_dim=64)  # the smallest head the GPU kernels instantiate
    model = Model.from_tensors(cfg, random_tensors(cfg, seed=4), device, *([np.float16] if device == "gpu" else []))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in (30, 200, 90, 260, 5, 150)]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    holding = make_engine(model, 16 * 64, block_size=8, max_batch_tokens=96)
    holding.scheduler.window = 0
    want = [o.token_ids for o in holding.generate(prompts, params)]
    peak_holding = holding.stats.peak_kv_blocks

    eng = make_engine(model, 16 * 64, block_size=8, max_batch_tokens=96)
    assert eng.scheduler.window == 40
    released = []
    computed = eng.scheduler.computed

    def spy(seq, n):
        computed(seq, n)
        released.append(seq.num_released)
        assert all(eng.blocks._refs[b] >= 1 for b in seq.block_table[seq.num_released:])
        # no block a query may still read is released
        assert seq.num_released * 8 <= max(0, seq.num_computed - 40 + 1 - WINDOW_READ_MARGIN)

    eng.scheduler.computed = spy
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == want
    assert max(released) >= 20 and eng.stats.peak_kv_blocks < peak_holding
    assert eng.kv_cache_usage() == 0.0


def test_blocks_behind_every_window_are_released_and_outputs_unchanged():
    released_window_case("cpu")


@pytest.mark.gpu
def test_gpu_blocks_behind_every_window_are_released_and_outputs_unchanged():
    """The kernels read released blocks (reused by other sequences) only where they mask them."""
    released_window_case("gpu")


def test_prompt_logprobs_equal_the_log_softmax_of_one_forward(cpu_model):
    """prompt_logprobs over chunked prefill (16-token steps) equal the log-softmax of one forward
    over the whole prompt, handed out once, in the first output; the prefix cache is not used."""
    from cuinfer.model.step_inputs import Batch

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cpu_model.config.vocab_size, 50).tolist()
    eng = make_engine(cpu_model, 4096, max_batch_tokens=16)
    eng.generate([prompt], SamplingParams(max_new_tokens=2))  # its blocks are now cached
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=3))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert outs[-1].num_cached_tokens == 0 and [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    got = outs[0].prompt_logprobs

    ref = make_engine(cpu_model, 4096)
    batch = Batch.from_chunks([(prompt, 0, ref.blocks.allocate(4))], 16)
    logits = cpu_model.forward(batch, ref.kv_cache, all_logits=True).astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        chosen, top = got[p]
        np.testing.assert_allclose(chosen, lp[p - 1, prompt[p]], atol=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-lp[p - 1])[:3])
