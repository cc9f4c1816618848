"""Speculative decoding on the NumPy backend: the ngram proposer, greedy verification (the engine's
tokens equal plain decoding at batch > 1 with prefix caching, preemption, abort, stops and
pipelined decode), rejection sampling (chi-square tests that fail for a wrong sampler), backoff."""
import numpy as np
import pytest
from test_engine import CharTokenizer, NumpyDecoder, make_engine, small_config
from test_model import random_tensors, tiny_config
from test_serving import run_online

from cuinfer.errors import CuinferError
from cuinfer.model.decoder import Model
from cuinfer.model.step_inputs import Batch
from cuinfer.serving import spec
from cuinfer.serving.sampling import SamplingParams
from cuinfer.serving.scheduler import Sequence
from cuinfer.serving.spec import accept_greedy, accept_sampled, inverse_cdf, ngram_match


@pytest.fixture(scope="module")
def cpu_model():
    cfg = small_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=3), "cpu")



def cheap_verify(eng):
    """The engine with its verify steps timed as costing one plain step: on NumPy a step's time
    grows with its rows, which says nothing of the GPU's, where the tests of the speculation
    machinery must see verify steps run."""
    note = eng.spec.note_verify_step
    eng.spec.note_verify_step = lambda num_seqs, seconds: note(num_seqs, 0.0) or 1.0
    return eng


def test_ngram_match_prefers_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    seq = [5, 1, 2, 9, 9, 7, 1, 2, 3, 4, 8, 1, 2]
    assert ngram_match(seq, 3) == [3, 4, 8]  # "1 2" occurs at 1 and 6: the latest with 3 tokens after
    assert ngram_match(seq + [3], 2) == [4, 8]  # "1 2 3" (n = 3) at 6
    assert ngram_match([4, 5, 6, 7], 3) == []  # no earlier occurrence of any suffix
    assert ngram_match([7, 7, 7], 4) == [7]  # the longest continuation when none holds k tokens
    assert ngram_match([1, 2, 3, 4, 1, 2, 3, 4, 0, 2, 3, 4], 2) == [0, 2]  # "2 3 4" at 1 and 5: the latest
    assert ngram_match([3], 2) == []


def test_ngram_match_equals_a_search_of_every_window():
    """Against the definition, window by window, on short sequences over small vocabularies (many
    repeats, ties between occurrences, matches at the very start)."""
    def brute(tokens, k, max_n, min_n):
        size = len(tokens)
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            hits = [h for h in range(size - n) if tokens[h:h + n] == tokens[size - n:]]
            if hits:
                full = [h for h in hits if h + n + k <= size]
                start = (full[-1] if full else hits[0]) + n
                return tokens[start:start + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 40))).tolist()
        k, min_n = int(rng.integers(1, 9)), int(rng.integers(1, 3))
        max_n = int(rng.integers(min_n, 6))
        assert ngram_match(tokens, k, max_n, min_n) == brute(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_accept_greedy():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept_greedy([1, 2], [3]) == [1]
    assert accept_greedy([2], []) == [2]


def chi2_fails(counts, probs, alpha_z=3.719) -> bool:
    """Pearson's chi-square test of counts against probs at the 1e-4 level (z of the normal's
    1 - 1e-4 quantile; the chi-square quantile by Wilson-Hilferty); cells expecting fewer than 5
    draws are pooled."""
    counts, expected = np.asarray(counts, float), np.asarray(probs, float) * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = keep.sum() - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * np.sqrt(2 / (9 * df))) ** 3
    return stat > crit


def run_rejection(sampler, p, q, trials, rng):
    """(first tokens, second tokens where there is one) of `sampler` with k = len(q) drafts drawn
    from the rows of q (None: fixed draft tokens 0, 1, 2, ...)."""
    k = len(p) - 1
    first, second = [], []
    for _ in range(trials):
        drafts = [int(rng.choice(len(p[j]), p=q[j])) for j in range(k)] if q is not None else list(range(k))
        out = sampler(p, drafts, q, rng.random(k + 1))
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return np.bincount(first, minlength=p.shape[1]), np.bincount(second, minlength=p.shape[1])


def wrong_sampler(p, drafts, q, u):
    """The classic bug: a rejected draft replaced by a draw from p instead of max(0, p - q)."""
    for j, x in enumerate(drafts):
        if u[j] * q[j, x] >= p[j, x]:
            return list(drafts[:j]) + [inverse_cdf(p[j], u[-1])]
    return list(drafts) + [inverse_cdf(p[len(drafts)], u[-1])]


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_follows_the_target(with_q):
    rng = np.random.default_rng(0)
    vocab, k = 6, 3
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = rng.dirichlet(np.ones(vocab), size=k) if with_q else None
    first, second = run_rejection(accept_sampled, p, q, 20000, rng)
    assert not chi2_fails(first, p[0]) and not chi2_fails(second, p[1])
    assert 0 < second.sum() < 20000  # drafts were both accepted and rejected
    if with_q:
        first, _ = run_rejection(wrong_sampler, p, q, 20000, rng)
        assert chi2_fails(first, p[0]), "the test cannot tell a wrong sampler"


def test_inverse_cdf_never_picks_a_zero_weight():
    w = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    assert [inverse_cdf(w, u) for u in (0.0, 0.29, 0.31, 0.999999)] == [1, 1, 3, 3]


def repetitive_prompts(n, seed=0, vocab=97):
    """Prompts that repeat a passage (what prompt lookup is for), some sharing a 40-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 40).tolist()
    out = []
    for i in range(n):
        passage = rng.integers(0, vocab, int(rng.integers(8, 30))).tolist()
        out.append((shared if i % 2 else []) + passage * 3 + passage[:int(rng.integers(1, 6))])
    return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_tokens_equal_plain_decoding_online(cpu_model, k):
    """Requests arriving two a step, two aborted mid-way, a KV cache small enough to preempt, prefix
    caching on: every finished request's tokens equal plain decoding's."""
    prompts = repetitive_prompts(12)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    abort_at = {3: 5, 8: 9}
    plain = run_online(make_engine(cpu_model, 4096), prompts, params, abort_at)
    eng = make_engine(cpu_model, 640, max_batch_tokens=96, speculative="ngram", num_speculative_tokens=k)
    got = run_online(eng, prompts, params, abort_at)
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.hit_tokens > 0
    assert eng.stats.accepted_tokens > 0 and eng.stats.draft_tokens > eng.stats.accepted_tokens
    assert set(got) == set(plain) and len(got) == len(prompts) - 2
    for i in plain:
        assert got[i] == plain[i], f"prompt {i}"
        assert len(got[i]) == 30
    eng.blocks.check()
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_greedy_with_stops_and_pipelined_decode(cpu_model):
    """End tokens and stop strings inside accepted drafts end the text where plain decoding does;
    with the pipelined decoder between verify steps the tokens are the same."""
    tok = CharTokenizer()
    prompts = repetitive_prompts(6, seed=1)
    plain_eng = make_engine(cpu_model, 4096, tokenizer=tok)
    full = plain_eng.generate(prompts, SamplingParams(max_new_tokens=40))
    eos = full[0].token_ids[12]
    stop = full[1].text[20:22]
    params = SamplingParams(max_new_tokens=40, stop=(stop,))
    want = make_engine(cpu_model, 4096, tokenizer=tok, eos=(eos,)).generate(prompts, params)
    for kw in ({}, dict(decoder=NumpyDecoder, async_decode=True)):
        eng = cheap_verify(make_engine(cpu_model, 4096, tokenizer=tok, eos=(eos,), speculative="ngram", **kw))
        got = eng.generate(prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
            [(o.token_ids, o.text, o.finish_reason) for o in want]
        assert eng.stats.accepted_tokens > 0
    assert any(o.finish_reason == "stop" for o in want) and any(o.finish_reason == "length" for o in want)
    assert eng.stats.pipelined_steps > 0  # backoff lets the decoder pipeline where drafts fail


def test_streamed_text_and_tokens_are_complete(cpu_model):
    tok = CharTokenizer()
    eng = cheap_verify(make_engine(cpu_model, 4096, tokenizer=tok, speculative="ngram"))
    prompts = repetitive_prompts(3, seed=2)
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    rid = eng.add_request(prompts[0], params)
    tokens, text, multi = [], "", False
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            text += out.new_text
            multi |= len(out.new_token_ids) > 1
    assert multi and tokens == out.token_ids and text == out.text and len(tokens) == 25


def test_backoff_stops_verifying_what_never_matches(cpu_model):
    """Drafts that are always rejected: after each miss the sequence decodes plainly for twice as
    many tokens, up to MAX_BACKOFF and to the tokens over which a failed verify step costs at most
    PROBE_SHARE of the decoding: (cost - 1) / PROBE_SHARE. So 200 tokens take few verify steps when
    a verify step costs 20 plain steps and many when it costs 1.1, with the same tokens. A verify
    step that gains fewer tokens than it costs in plain steps is a miss too."""
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    prompt = list(range(40))
    plain = make_engine(cpu_model, 4096).generate([prompt], params)[0].token_ids
    never = min(set(range(97)) - set(plain))
    verify_rows = {}
    for cost in (20.0, 1.1):
        eng = make_engine(cpu_model, 4096, speculative="ngram", num_speculative_tokens=4)
        eng.spec.proposer = type("Wrong", (), {"propose": lambda self, seqs, ks, seeds: [
            spec.Draft([never] * k) for k in ks]})()
        note = eng.spec.note_verify_step
        eng.spec.note_verify_step = lambda num_seqs, seconds, c=cost, note=note: note(num_seqs, None) and c
        assert eng.generate([prompt], params)[0].token_ids == plain
        assert eng.stats.accepted_tokens == 0
        verify_rows[cost] = eng.stats.verify_rows
    assert 0 < verify_rows[20.0] <= 10  # misses at 0, 2, 6, 14, 30, 62, 126 tokens
    assert verify_rows[1.1] >= 60  # backoffs of at most 0.1 / 0.05 = 2 tokens
    s = spec.Speculator(spec.NgramProposer(), 4)
    seq = eng.scheduler.running or type("S", (), {})()
    seq.params, seq.output_ids = params, [0] * 10
    assert s.due(seq)
    s.record(seq, 4, 0)
    s.record(seq, 4, 0)
    assert not s.due(seq)
    seq.output_ids += [0] * 4
    assert s.due(seq)
    s.record(seq, 4, 2)
    assert s.due(seq)
    # a verify step that cost 4 plain steps pays only if it gained more than 4 tokens
    assert s.note_verify_step(1, 0.004) == 1.0  # no plain step timed yet
    s.note_plain_step(1, 0.002)
    s.note_plain_step(1, 0.001)  # the fastest recent plain step is the unit
    s.note_plain_step(1, 0.003)
    assert s.note_verify_step(3, 0.004) == 1.0  # another batch bucket
    s.record(seq, 4, 3, s.note_verify_step(1, 0.004))
    assert not s.due(seq)
    seq.output_ids += [0] * 2
    s.record(seq, 4, 4, s.note_verify_step(1, 0.004))
    assert s.due(seq)
    # a plain step is timed first in each batch bucket, and again after PROBE_EVERY verify steps
    probe = spec.Speculator(spec.NgramProposer(), 4)
    live = Sequence(0, [1, 2, 3], params)
    live.output_ids, live.num_computed = [4], 3
    assert not probe.wants([(live, 1)])
    probe.note_plain_step(1, 0.001)
    assert probe.wants([(live, 1)])
    for _ in range(spec.PROBE_EVERY):
        probe.note_verify_step(1, 0.001)
    assert not probe.wants([(live, 1)])


def test_not_adaptive_verifies_every_step():
    """Speculator(adaptive=False): every decoding step with a due sequence verifies (no plain step
    timed first, whatever the cost) and misses never back off."""
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    always = spec.Speculator(spec.NgramProposer(), 4, adaptive=False)
    seq = Sequence(0, [1, 2, 3], params)
    seq.output_ids, seq.num_computed = [4], 3
    assert always.wants([(seq, 1)])
    for _ in range(5):
        always.record(seq, 4, 0, cost=50.0)
    assert always.due(seq) and always.wants([(seq, 1)])
    assert not always.wants([(seq, 2)])  # a prompt chunk in the step


def test_drafts_keep_a_small_batch_within_the_gemv_rows():
    """At batch 2-8 a sequence's drafts are cut so that the padded verify step (batch bucket x
    q_bucket(k + 1) rows) stays within GEMV_ROWS; batch 1 and batches that already fill the GEMV keep k."""
    from cuinfer.ops.linear import GEMV_ROWS
    from cuinfer.serving.verify import q_bucket

    for b in range(1, 40):
        for k in range(1, spec.MAX_SPECULATIVE_TOKENS + 1):
            got = spec.drafts_within_gemv(b, k)
            rows = spec.bucket(b) * q_bucket(got + 1)
            assert 1 <= got <= k
            assert rows <= GEMV_ROWS or got == k  # within the rows, or uncut
            if 2 * spec.bucket(b) <= GEMV_ROWS:
                assert rows <= GEMV_ROWS
                assert got == k or spec.bucket(b) * q_bucket(got + 2) > GEMV_ROWS  # the most that fit
    assert [spec.drafts_within_gemv(b, 8) for b in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 8]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    seqs = [Sequence(i, [1, 2, 3], params) for i in range(4)]
    assert spec.Speculator(spec.NgramProposer(), 8).budgets(seqs, 4096) == [2] * 4


def test_a_step_verifies_only_when_it_pays_for_the_batch():
    """The due sequences' expected extra tokens must exceed what a verify step costs the whole batch:
    (cost - 1) x batch, with cost the bucket's verify steps in plain steps."""
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    seqs = []
    for i in range(16):
        seq = Sequence(i, [1, 2, 3], params)
        seq.output_ids, seq.num_computed = [4], 3
        seqs.append(seq)
    plan = [(s, 1) for s in seqs]
    gate = spec.Speculator(spec.NgramProposer(), 4)
    gate.note_plain_step(16, 0.001)
    assert gate.wants(plan)  # no verify step timed yet: each due sequence's prior gain is k / 2 + 1
    gate.note_verify_step(16, 0.002)  # cost 2: 16 sequences must gain 16 extra tokens
    assert gate.wants(plan)  # 16 x 2 expected
    for s in seqs[1:]:
        gate.record(s, 4, 0, 2.0)  # misses: they back off
    assert not gate.wants(plan)  # one due sequence, 2 extra tokens expected
    gate.note_plain_step(1, 0.001)
    gate.note_verify_step(1, 0.002)
    assert gate.wants(plan[:1])  # alone it pays (2 > cost - 1)
    gate.record(seqs[0], 4, 1, 2.0)  # gained 2 tokens in a step that cost 2: a miss
    assert not gate.due(seqs[0])
    # a sequence's average decides: one step that keeps no draft after one that kept four is no miss
    seq = seqs[1]
    seq.output_ids += [0] * 8  # past its backoff
    gate.record(seq, 4, 4, 2.0)  # average gain 5
    gate.record(seq, 4, 0, 2.0)  # 0.5 x 1 + 0.5 x 5 = 3 > 2
    assert gate.due(seq)
    gate.record(seq, 4, 0, 2.0)  # 2 <= 2: a miss
    assert not gate.due(seq)


def test_bad_options_are_one_clear_error(cpu_model):
    with pytest.raises(CuinferError, match="speculative: got 'eagle'"):
        make_engine(cpu_model, 1024, speculative="eagle")
    with pytest.raises(CuinferError, match="num_speculative_tokens: got 0"):
        make_engine(cpu_model, 1024, speculative="ngram", num_speculative_tokens=0)


def next_token_probs(model, prefixes):
    """float64 [len(prefixes), vocab]: softmax of the model's next-token logits after each prefix."""
    from cuinfer.model.kv_cache import CacheShape, KVCache

    cfg = model.config
    out = []
    for ids in prefixes:
        cache = KVCache.allocate(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16),
                                 model.dtype, np, 64)
        batch = Batch.from_chunks([(ids, 0, list(range(4)))], 16)
        z = model.forward(batch, cache)[0].astype(np.float64)
        out.append(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
    return np.array(out)


def joint_probs(model, prompt, n: int) -> np.ndarray:
    """float64 [vocab ** n]: the model's probability of each n-token continuation of prompt."""
    vocab = model.config.vocab_size
    joint = np.ones(1)
    for i in range(n):
        prefixes = [prompt + list(np.unravel_index(c, (vocab,) * i)) for c in range(vocab ** i)]
        joint = (joint[:, None] * next_token_probs(model, prefixes)).reshape(-1)
    return joint


TINY = dict(vocab_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def sampled_quads(model, prompt, n, speculative):
    """Counts [vocab ** 4] of the four tokens of n seeded requests (temperature 1, all admitted in
    one step: the first token comes from the prompt's step, the second from a plain step (timed
    before any verify step), the last two from a verify step of one draft), and the engine's stats."""
    vocab = model.config.vocab_size
    eng = make_engine(model, 131072, max_batch_tokens=65536, max_num_seqs=n, speculative=speculative,
                      num_speculative_tokens=3)
    outs = eng.generate([prompt] * n, [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s) for s in range(n)])
    cells = [np.ravel_multi_index(o.token_ids, (vocab,) * 4) for o in outs]
    return np.bincount(cells, minlength=vocab ** 4), eng.stats


def test_sampled_tokens_follow_the_model_in_the_engine(monkeypatch):
    """Four-token vocabulary, a prompt whose continuation prompt lookup drafts: over 4,000 seeds the
    four tokens follow the model's joint distribution; always accepting the drafts fails."""
    model = Model.from_tensors(tiny_config(**TINY), random_tensors(tiny_config(**TINY), seed=5), "cpu")
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    joint = joint_probs(model, prompt, 4)
    counts, stats = sampled_quads(model, prompt, 4000, "ngram")
    assert stats.verify_rows == 4000 and 400 < stats.accepted_tokens < 3600
    assert not chi2_fails(counts, joint)
    monkeypatch.setattr(spec, "accept_sampled", lambda p, d, q, u: list(d) + [inverse_cdf(p[len(d)], u[-1])])
    counts, _ = sampled_quads(model, prompt, 4000, "ngram")
    assert chi2_fails(counts, joint), "the test cannot tell a sampler that keeps every draft"


@pytest.fixture(scope="module")
def other_model():
    """small_config with other weights: a draft that is often wrong."""
    cfg = small_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=4), "cpu")


def test_draft_proposal_after_a_dropped_one(cpu_model):
    """The engine drops a proposal whose KV slots do not fit and decodes one token plainly; when that
    token is the first draft, every token of the sequence has draft K/V, and the next proposal must
    still run the last token again for its logits: the target drafting for itself proposes its own
    greedy continuation, shifted by that token."""
    from cuinfer.model.kv_cache import CacheShape, KVCache
    from cuinfer.serving.draft import DraftProposer

    cfg = cpu_model.config
    cache = KVCache.allocate(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), np.float32,
                             np, 512)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = repetitive_prompts(1, seed=5)[0]
    want = make_engine(cpu_model, 4096).generate([prompt], params)[0].token_ids
    proposer = DraftProposer(cpu_model, cpu_model, cache)
    seq = Sequence(0, list(prompt), params, block_table=[0])  # a live sequence of the target
    first = proposer.propose([seq], [3], [0])[0].tokens
    assert first == want[:3]
    seq.output_ids.append(first[0])  # the proposal dropped, d1 decoded plainly
    assert proposer.propose([seq], [3], [0])[0].tokens == want[1:4]


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_greedy_tokens_equal_plain_decoding_online(cpu_model, other_model, draft):
    prompts = repetitive_prompts(10, seed=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    abort_at = {2: 6}
    plain = run_online(make_engine(cpu_model, 4096), prompts, params, abort_at)
    d = cpu_model if draft == "same" else other_model
    eng = make_engine(cpu_model, 640, max_batch_tokens=96, speculative=d, num_speculative_tokens=3)
    assert run_online(eng, prompts, params, abort_at) == plain
    assert eng.scheduler.num_preemptions > 0
    st = eng.stats
    if draft == "same":  # the target drafting for itself: every draft accepted
        # every verify row kept all its drafts; more than one a row on average (at batch 3-8
        # drafts_within_gemv cuts k = 3 to 2 or 1)
        assert st.accepted_tokens == st.draft_tokens > 0
        assert st.mean_accepted_length == pytest.approx(1 + st.draft_tokens / st.verify_rows) and st.mean_accepted_length > 2
    else:
        assert st.draft_tokens > st.accepted_tokens
    proposer = eng.spec.proposer
    proposer.blocks.check()
    proposer.propose([], [], [])  # drops the finished sequences' state
    assert proposer.blocks.num_free == proposer.blocks.num_blocks


def test_draft_model_sampled_tokens_follow_the_target(monkeypatch):
    """As the ngram test, with a draft model whose distributions q differ from the target's: the
    four tokens follow the target; resampling a rejected draft from p instead of max(0, p - q) fails."""
    model = Model.from_tensors(tiny_config(**TINY), random_tensors(tiny_config(**TINY), seed=5), "cpu")
    draft = Model.from_tensors(tiny_config(**TINY), random_tensors(tiny_config(**TINY), seed=6), "cpu")
    prompt = [3, 1, 0, 2, 2, 1]
    joint = joint_probs(model, prompt, 4)
    counts, stats = sampled_quads(model, prompt, 4000, draft)
    assert stats.verify_rows == 4000 and 400 < stats.accepted_tokens < 3600
    assert not chi2_fails(counts, joint)
    monkeypatch.setattr(spec, "accept_sampled", wrong_sampler)
    counts, _ = sampled_quads(model, prompt, 4000, draft)
    assert chi2_fails(counts, joint), "the test cannot tell a sampler that resamples from p"


def test_draft_model_needs_the_target_vocabulary(cpu_model):
    cfg = tiny_config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    small = Model.from_tensors(cfg, random_tensors(cfg, seed=1), "cpu")
    with pytest.raises(CuinferError, match="vocabulary of 50 tokens, the target's has 97"):
        make_engine(cpu_model, 1024, speculative=small)


def test_padded_verify_batch_gives_the_rows_of_the_chunks(cpu_model):
    """The GPU verifier's static layout (chunks padded to one q_len, the batch to a bucket, a row per
    token, slot -1 and context 0 for padding), run on the NumPy backend: the real rows' logits and
    the KV cache equal those of one forward over the chunks as they are, padding writes no slot, and
    a greedy step gives the rows' argmax."""
    from cuinfer.model.kv_cache import CacheShape, KVCache
    from cuinfer.model.step_inputs import input_views
    from cuinfer.serving.verify import Verifier, pack_chunks

    cfg, bs = cpu_model.config, 16
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs)
    caches = [KVCache.allocate(shape, np.float32, np, 1024) for _ in range(3)]
    rng = np.random.default_rng(0)
    chunks = [(rng.integers(0, 97, n).tolist(), start, table)
              for n, start, table in ((3, 0, [5]), (1, 17, [2, 7]), (5, 30, [9, 3, 4]))]
    prefixes = [(rng.integers(0, 97, start).tolist(), 0, table) for _, start, table in chunks if start]
    for cache in caches:  # the same cached prefixes in all
        cpu_model.forward(Batch.from_chunks(prefixes, bs), cache)
    want = cpu_model.forward(Batch.from_chunks(chunks, bs), caches[0], all_logits=True)
    b, q, width = 4, 5, 4
    buf = np.zeros(b * q * (4 + width), dtype=np.int32)
    pack_chunks(buf, chunks, b, q, width, bs)
    inputs = input_views(buf, b * q, width)
    assert (inputs.slot_mapping == -1).sum() == b * q - 9 and (inputs.context_lens == 0).sum() == b * q - 9
    got = cpu_model.decode(inputs, caches[1], width * bs, verify=q)
    rows = [0, 1, 2, 5, 10, 11, 12, 13, 14]
    np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-5)
    unused = sorted(set(range(caches[1].num_blocks)) - {b for _, _, t in chunks for b in t})
    for layer in range(cfg.num_hidden_layers):
        for a, c in zip(caches[0].layer(layer), caches[1].layer(layer)):
            np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
            assert not c[unused].any()
    tokens = Verifier(cpu_model, caches[2]).run(chunks, greedy=True)
    np.testing.assert_array_equal(tokens, np.argmax(want, axis=-1))


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_gpu_verify_graph_equals_eager(cp, dtype):
    """A verify step replayed from its CUDA graph gives the eager step's logits bit for bit (same
    kernels on the same padded buffers), for several (batch, q_len) shapes, and writes the same KV."""
    from cuinfer.model.kv_cache import CacheShape, KVCache
    from cuinfer.ops import runtime
    from cuinfer.serving.verify import Verifier

    dt = runtime.bfloat16 if dtype == "bfloat16" else dtype
    cfg = tiny_config(num_hidden_layers=2)
    model = Model.from_tensors(cfg, random_tensors(cfg, seed=3), "gpu", dt)
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16)
    rng = np.random.default_rng(0)
    for n_seqs, q in ((1, 2), (1, 9), (3, 5)):
        caches = [KVCache.allocate(shape, model.dtype, cp, 4096) for _ in range(2)]
        tables = [list(range(20 * i, 20 * i + 20)) for i in range(n_seqs)]
        starts = rng.integers(1, 300, n_seqs).tolist()
        prefixes = [(rng.integers(0, cfg.vocab_size, s).tolist(), 0, t) for s, t in zip(starts, tables)]
        for cache in caches:
            model.forward(Batch.from_chunks(prefixes, 16).to(cp), cache)
        chunks = [(rng.integers(0, cfg.vocab_size, int(rng.integers(1, q + 1))).tolist(), s, t)
                  for s, t in zip(starts, tables)]
        graph = Verifier(model, caches[0]).run(chunks)
        eager = Verifier(model, caches[1], use_graphs=False).run(chunks)
        cp.testing.assert_array_equal(graph, eager)
        cp.testing.assert_array_equal(caches[0].k, caches[1].k)


@pytest.mark.gpu
def test_gpu_speculative_greedy_agrees_with_plain(cp):
    """On the GPU the verify step (flash prefill attention, k + 1 rows) and the decode step (split-K
    paged attention, one row) round differently in fp16, so a near-tie may flip a greedy token (see
    test_engine's GPU test): >= 90% of the sequences equal plain decoding's, with ngram and with the
    target as its own draft, whose drafts are then (almost) all accepted. Four sequences at a time
    with k = 3: 16 rows, a captured verify step in fp16."""
    cfg = tiny_config(num_hidden_layers=2)
    model = Model.from_tensors(cfg, random_tensors(cfg, seed=3), "gpu", np.float16)
    prompts = repetitive_prompts(16, seed=5, vocab=cfg.vocab_size)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = make_engine(model, 16384).generate(prompts, params)
    for speculative in ("ngram", model):
        eng = make_engine(model, 16384, speculative=speculative, num_speculative_tokens=3, max_num_seqs=4)
        outs = eng.generate(prompts, params)
        same = np.mean([a.token_ids == b.token_ids for a, b in zip(outs, plain)])
        assert same >= 0.9, f"{speculative}: only {same:.0%} of outputs equal plain decoding's"
        assert eng.stats.accepted_tokens > 0
        if speculative is model:
            assert eng.stats.accepted_tokens >= 0.95 * eng.stats.draft_tokens


def test_step_shape():
    from cuinfer.serving.verify import step_shape

    assert step_shape([([1, 2], 10, [0]), ([1, 2, 3], 250, list(range(16)))], 16) == (2, 3, 16)
    assert step_shape([([1], 300, list(range(19))), ([1], 0, [1]), ([1], 0, [2])], 16) == (4, 1, 32)
    assert step_shape([([1, 2], 254, list(range(17)))], 16) == (1, 2, 32)  # a table past the context
    # q_len: the longest chunk rounded up to 1, 2, 3, 5, 9 or 16 rows
    assert [step_shape([([1] * n, 0, [0])], 16)[1] for n in range(1, 19)] == \
        [1, 2, 3, 5, 5, 9, 9, 9, 9] + [16] * 7 + [17, 18]


@pytest.mark.parametrize("source", ["ngram", "self"])
def test_mixed_requests_in_one_batch(cpu_model, source):
    """Greedy, sampled, penalized and logprobs requests decoding together: rows with a penalty or
    logprobs never speculate and get plain decoding's tokens (and logprobs), greedy ones too, and
    sampled ones their max_new_tokens. With the target as its own draft every draft is accepted."""
    prompts = repetitive_prompts(8, seed=7)
    kinds = [SamplingParams(max_new_tokens=20, ignore_eos=True),
             SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3),
             SamplingParams(max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)]
    params = [kinds[i % 4] for i in range(8)]
    plain = make_engine(cpu_model, 4096).generate(prompts, params)
    eng = make_engine(cpu_model, 4096, speculative="ngram" if source == "ngram" else cpu_model)
    got = []
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
    lps = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            lps[out.request_id] += out.new_logprobs
            if out.finished:
                got.append(out)
    got.sort(key=lambda o: ids.index(o.request_id))
    st = eng.stats
    assert st.verify_rows > 0
    if source == "self":
        assert st.accepted_tokens == st.draft_tokens > 0
    for i, (a, b) in enumerate(zip(got, plain)):
        assert len(a.token_ids) == 20
        if i % 4 != 1:
            assert a.token_ids == b.token_ids, i
    assert all(len(lps[ids[i]]) == 20 for i in (3, 7))
