"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

    engine = Engine(model, cache, speculative="ngram", num_speculative_tokens=4)   # or a draft Model

A step in which every sequence decodes becomes a verify step when some sequence is due to
speculate (Speculator.wants). Each due sequence gets up to k draft tokens from the proposer:
NgramProposer (prompt lookup: the continuation of the longest earlier match of the sequence's last
n tokens, n = 4..1) or DraftProposer (a smaller model with the same tokenizer, cuinfer/serving/
draft.py). The target scores [last token, d1..dk] of every sequence in one step (Verifier,
cuinfer/serving/verify.py: the decode step's kernels over k_i + 1 rows per sequence, a CUDA graph on
the GPU, ending in each row's argmax when no row needs logits); each sequence keeps the drafts the verification accepts plus one token of the
target's, so a step yields 1..k+1 tokens per sequence (docs/speculative.md):
- greedy rows (accept_greedy): the drafts that equal the target's argmax, then the argmax after
  them, which is the token plain greedy decoding would give;
- sampled rows (accept_sampled): rejection sampling; draft x is accepted with probability
  min(1, p(x) / q(x)), else the token comes from norm(max(0, p - q)): the tokens follow the
  target's distribution p exactly, whatever the draft distribution q (a point mass for ngram).
Rows with penalties or logprobs never speculate (their distribution depends on every token before);
a sequence without drafts in a verify step is sampled from its one row as a plain step samples it.

Backoff: each sequence keeps a moving average of the tokens its verify steps gained (accepted + 1).
A verify step is a miss for it when that average, this step included, is no more than the step
cost in plain decode steps of the same batch (measured: the engine times both kinds of step, and
runs a plain step to time it before the first verify step of a batch bucket and after every
PROBE_EVERY), or when it had nothing to propose: one short run of accepted drafts among long ones
is no miss. After m misses in a row the sequence decodes plainly for the next min(2**m,
(cost - 1) / PROBE_SHARE, MAX_BACKOFF) tokens, through the pipelined CUDA-graph decode path, and
starts its average afresh, so text the drafts do not predict, or drafts that cost more than they
gain, do not slow decoding: the verify step that ends a backoff, when it misses again, costs its
cost - 1 extra plain steps once every (cost - 1) / PROBE_SHARE tokens or more, at most PROBE_SHARE
of the sequence's decoding. Where verifying is cheap (ngram drafts at batch 1: 1.5-1.7 plain
steps) that bound keeps backoffs short, so drafts are tried again soon after the text turns
predictable; a costly draft model backs off up to MAX_BACKOFF tokens. A verify step that pays
resets the count.

A step verifies only when it should pay for the whole batch: the tokens the due sequences are
expected to gain beyond their one (their averages; k / 2 + 1 before the first, k as budgets cuts
it) exceed what the step costs the others, (cost - 1) x batch, with cost the cheapest of the
bucket's recent verify steps in plain steps (a step that met a new shape, and so captured a
graph, is not timed: Engine._spec_step). One due sequence among many does not turn every step of
the batch into a synchronous verify step.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import CuinferError
from ..ops import runtime
from ..ops.linear import GEMV_ROWS
from .runner import bucket
from .sampling import graph_sampleable, token_probs
from .verify import Q_BUCKETS, q_bucket

MAX_SPECULATIVE_TOKENS = 16
MAX_BACKOFF = 256  # output tokens decoded without drafts after repeated misses, at most
PROBE_SHARE = 0.05  # the share of a backed-off sequence's decoding its failed verify steps may cost
PROBE_EVERY = 32  # verify steps of a batch bucket after which a plain step is timed again
PLAIN_SAMPLES = 8  # plain step times kept per batch bucket (their minimum is the estimate)
SMOOTHING = 0.5  # weight of the newest gain in a sequence's moving average
NGRAM_MAX, NGRAM_MIN = 4, 1


@dataclass
class Draft:
    tokens: list  # the proposed tokens
    q: object = None  # float64 [len(tokens), vocab]: the distributions they were drawn from (None: point masses)


NO_DRAFT = Draft([])


def speculable(params) -> bool:
    """Whether a request's tokens may be drafted: no penalties and no logprobs."""
    return graph_sampleable(params)


def spec_uniforms(seed: int, step: int, stream: int, n: int) -> np.ndarray:
    """n uniforms in [0, 1) for a request's verify step at output length `step` (stream 0: the
    verification, 1: the draft model's sampling): reproducible in any batch, as draw_uniform."""
    return np.random.default_rng([seed, step, stream]).random(n)


def ngram_match(tokens, k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> list:
    """Up to k tokens that followed an earlier occurrence of the last n tokens, for the largest n in
    max_n..min_n that occurs earlier: the latest such occurrence with k tokens after it, else the
    first one (the longest continuation). tokens: ids, or their int32 bytes (as NgramProposer keeps
    them). One vectorized pass finds the first earlier occurrence of the last token; then a byte
    search at token boundaries finds that of the last 2, 3, ... tokens until one has none (a
    longer suffix occurs only where a shorter one does), and the latest occurrence of the longest
    with room for k tokens after it."""
    data = tokens if isinstance(tokens, (bytes, bytearray)) else np.asarray(tokens, np.int32).tobytes()
    arr = np.frombuffer(data, np.int32)
    size = len(arr)
    same = arr[:size - 1] == arr[-1] if size > 1 else np.zeros(1, bool)
    first = int(same.argmax())  # the first earlier occurrence of the last token, if same[first]
    if not same[first]:
        return []
    n, first = 1, 4 * first
    while n < min(max_n, size - 1):
        found = _find(data, data[4 * (size - n - 1):], 4 * (size - 1))
        if found < 0:
            break
        n, first = n + 1, found
    if n < min_n:
        return []
    latest = _rfind(data, data[4 * (size - n):], 4 * max(0, size - k))
    start = (latest if latest >= 0 else first) + 4 * n
    return np.frombuffer(data[start:start + 4 * k], np.int32).tolist()


def _rfind(data, pattern, end: int) -> int:
    """The byte offset of the last occurrence of pattern in data[:end] at a token boundary, or -1."""
    i = data.rfind(pattern, 0, end)
    while i % 4 and i > 0:
        i = data.rfind(pattern, 0, i + len(pattern) - 1)
    return i


def _find(data, pattern, end: int) -> int:
    """The byte offset of the first occurrence of pattern in data[:end] at a token boundary, or -1."""
    i = data.find(pattern, 0, end)
    while i % 4 and i > 0:
        i = data.find(pattern, i + 1, end)
    return i


class NgramProposer:
    """Prompt lookup: drafts from the sequence's own prompt and output (no model). Each sequence's
    tokens are kept as int32 bytes that grow by the tokens appended since its last proposal (a
    sequence's tokens are only ever appended, and a verify step sees none pending), so a proposal
    converts only those; the bytes go with their sequences (weak keys)."""

    def __init__(self):
        self._tokens = weakref.WeakKeyDictionary()  # Sequence -> bytearray of its int32 tokens

    def propose(self, seqs, budgets, seeds) -> list:
        return [Draft(ngram_match(self._bytes(s), k)) if k else NO_DRAFT for s, k in zip(seqs, budgets)]

    def _bytes(self, seq) -> bytearray:
        data = self._tokens.setdefault(seq, bytearray())
        data += np.asarray(seq.token_slice(len(data) // 4, seq.num_tokens), np.int32).tobytes()
        return data


def accept_greedy(targets, drafts) -> list:
    """The tokens a greedy sequence keeps: the drafts while they equal the target's argmax at the
    row before them (targets: [k + 1] argmax tokens), then the target's token after the last one."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(drafts[:a]) + [int(targets[a])]


def inverse_cdf(weights, u: float) -> int:
    """The token whose cumulative weight first passes u * total (weights >= 0, not all 0)."""
    c = np.cumsum(weights)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, int(np.flatnonzero(weights)[-1]))


def accept_sampled(p, drafts, q, uniforms) -> list:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023). p: [k + 1, vocab] the target's
    distributions at the k + 1 rows; q: [k, vocab] those the drafts were drawn from (None: point
    masses at them); uniforms: k + 1 draws. Draft x at row j is kept when u_j * q_j(x) < p_j(x)
    (probability min(1, p/q)); the first rejected one is replaced by a draw from max(0, p_j - q_j),
    normalised; when all are kept, a last token is drawn from p_k."""
    for j, x in enumerate(drafts):
        qj = q[j] if q is not None else np.eye(1, p.shape[1], x)[0]  # a point mass at x
        if uniforms[j] * qj[x] < p[j, x]:
            continue
        residual = np.maximum(p[j] - qj, 0.0)
        if not residual.any():  # p == q: a rejection had probability 0
            residual = p[j]
        return list(drafts[:j]) + [inverse_cdf(residual, uniforms[-1])]
    return list(drafts) + [inverse_cdf(p[len(drafts)], uniforms[-1])]


def drafts_within_gemv(num_seqs: int, k: int) -> int:
    """Drafts a sequence may take in a verify step of num_seqs sequences: k, or fewer where the step's
    padded rows (batch bucket x q_bucket(k + 1)) would pass the GEMV's GEMV_ROWS while a step with one
    draft each stays within them. Past those rows the linear layers run cuBLAS's GEMM: SmolLM2 verify
    steps of 18-36 rows took 1.6-2.4 plain steps of wall time on the H100, those of 9 rows 1.5-1.7,
    so at batch 2-8 fewer drafts a sequence gain more per unit of cost. Larger batches are left to
    the cost rule (their plain steps already fill the GEMV)."""
    b = bucket(num_seqs)
    if b * q_bucket(k + 1) <= GEMV_ROWS or 2 * b > GEMV_ROWS:
        return k
    return min(k, max(q for q in Q_BUCKETS if b * q <= GEMV_ROWS) - 1)


@dataclass
class _PlainTimes:
    """A batch bucket's plain decode steps: their last wall times, and verify steps since."""
    seconds: deque = field(default_factory=lambda: deque(maxlen=PLAIN_SAMPLES))
    verifies: int = 0
    costs: deque = field(default_factory=lambda: deque(maxlen=PLAIN_SAMPLES))  # verify steps', in plain steps


@dataclass
class _Backoff:
    resume_at: int = 0  # output length from which the sequence proposes again
    misses: int = 0
    gain: float = 0.0  # tokens gained per verify step, a moving average (0: none yet)


class Speculator:
    def __init__(self, proposer, num_tokens: int, adaptive: bool = True):
        """adaptive=False: every step in which a sequence may draft verifies, and nothing backs off
        (the drafts' acceptance and raw cost, as `bench spec`'s "always" rows measure them)."""
        if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise CuinferError(f"num_speculative_tokens: got {num_tokens}, need 1..{MAX_SPECULATIVE_TOKENS}")
        self.proposer, self.k, self.adaptive = proposer, num_tokens, adaptive
        self._backoff = {}  # Sequence -> _Backoff, while it runs
        self._plain = {}  # batch bucket -> _PlainTimes

    def due(self, seq) -> bool:
        """Whether seq proposes drafts at its next decode step (from lengths only: the pipelined
        decode asks with a token still on the device)."""
        b = self._backoff.get(seq)
        return speculable(seq.params) and (b is None or len(seq.output_ids) >= b.resume_at)

    def wants(self, plan) -> bool:
        """Whether the step `plan` ([(sequence, tokens)]) becomes a verify step: every sequence
        decodes and one is due."""
        decoding = all(n == 1 and s.remaining == 1 and s.num_computed >= len(s.prompt_ids) for s, n in plan)
        if not self.adaptive:
            return decoding and any(self.due(s) for s, _ in plan)
        if not decoding or self._probe(len(plan)):
            return False
        k = drafts_within_gemv(len(plan), self.k)
        extra = sum(self._gain(s, k) - 1 for s, _ in plan if self.due(s))
        costs = self._plain[bucket(len(plan))].costs
        return extra > 0 and extra > (min(costs, default=1.0) - 1) * len(plan)

    def _gain(self, seq, k: int) -> float:
        b = self._backoff.get(seq)
        return b.gain if b is not None and b.gain else k / 2 + 1

    def budgets(self, seqs, max_len: int) -> list:
        """Draft tokens each sequence may take: drafts_within_gemv(batch, k), less what would pass
        max_new_tokens or the context."""
        k = drafts_within_gemv(len(seqs), self.k)
        return [max(0, min(k, s.params.max_new_tokens - len(s.output_ids) - 1, max_len - s.num_tokens - 1))
                if self.due(s) else 0 for s in seqs]

    def propose(self, seqs, budgets, seeds) -> list:
        self._backoff = {s: b for s, b in self._backoff.items() if s.finish_reason is None}
        return self.proposer.propose(seqs, budgets, seeds)

    def _probe(self, num_seqs: int) -> bool:
        """Whether the next decode step of this batch bucket must be plain, to be timed: none was
        yet, or PROBE_EVERY verify steps ran since the last."""
        t = self._plain.get(bucket(num_seqs))
        return t is None or not t.seconds or t.verifies >= PROBE_EVERY

    def note_plain_step(self, num_seqs: int, seconds: float) -> None:
        """A decode step without drafts of num_seqs sequences took `seconds` (wall time)."""
        t = self._plain.setdefault(bucket(num_seqs), _PlainTimes())
        t.seconds.append(seconds)
        t.verifies = 0

    def note_verify_step(self, num_seqs: int, seconds: float | None) -> float:
        """A verify step of num_seqs sequences took `seconds` (None: not timed, it met a new shape):
        its cost in plain decode steps of the same batch bucket (their fastest recent one: a graph
        capture or a stall does not make verify steps look cheap), 1.0 while none was timed."""
        t = self._plain.setdefault(bucket(num_seqs), _PlainTimes())
        t.verifies += 1
        if not t.seconds or seconds is None:
            return 1.0
        t.costs.append(seconds / min(t.seconds))
        return t.costs[-1]

    def record(self, seq, proposed: int, accepted: int, cost: float = 1.0) -> None:
        """A due sequence's verify result: it proposed `proposed` drafts and kept `accepted` in a
        step that cost `cost` plain steps. A miss (nothing proposed, or its average gain, this step
        included, no more than the cost) backs off, for fewer tokens the cheaper the step was."""
        if not self.adaptive:
            return
        b = self._backoff.setdefault(seq, _Backoff())
        gain = accepted + 1 if not b.gain else SMOOTHING * (accepted + 1) + (1 - SMOOTHING) * b.gain
        if proposed and gain > cost:
            b.misses, b.resume_at, b.gain = 0, 0, gain
        else:  # when it is due again its gain is unknown again
            b.misses, b.gain = b.misses + 1, 0.0
            bound = max(1, int((cost - 1) / PROBE_SHARE))
            b.resume_at = len(seq.output_ids) + min(2 ** b.misses, bound, MAX_BACKOFF)


def verify(logits, seqs, drafts, seeds) -> list:
    """The tokens each sequence keeps from a verify step: logits float32 [sum(k_i + 1), vocab]
    (each sequence's rows in order, on the model's device), drafts: a Draft per sequence, seeds:
    each request's sampling seed. Only argmaxes leave the device for greedy rows; sampled rows
    bring their distributions (sampling.token_probs) to the host."""
    xp = runtime.require_cupy() if runtime.is_device_array(logits) else np
    host = (lambda a: a.get()) if xp is not np else (lambda a: a)
    starts = np.cumsum([0] + [len(d.tokens) + 1 for d in drafts])
    targets = host(xp.argmax(logits, axis=-1))
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    probs = {}
    if sampled:
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in sampled])
        params = [seqs[i].params for i in sampled for _ in range(starts[i + 1] - starts[i])]
        p = token_probs(logits[xp.asarray(rows)], params)
        at = np.cumsum([0] + [starts[i + 1] - starts[i] for i in sampled])
        probs = {i: p[at[j]:at[j + 1]] for j, i in enumerate(sampled)}
    kept = []
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        if i in probs:
            u = spec_uniforms(seeds[i], len(s.output_ids), 0, len(d.tokens) + 1)
            kept.append(accept_sampled(probs[i], d.tokens, d.q, u))
        else:
            kept.append(accept_greedy(targets[starts[i]:starts[i + 1]], d.tokens))
    return kept


def make_speculator(speculative, num_tokens: int, target, kv_cache, use_graphs: bool = True):
    """The engine's Speculator: None (no speculation), "ngram", or a draft Model with the target's
    vocabulary (it gets a KV cache of kv_cache's size: serving/draft.py)."""
    if speculative is None:
        return None
    if speculative == "ngram":
        return Speculator(NgramProposer(), num_tokens)
    if isinstance(speculative, str):
        raise CuinferError(f"speculative: got {speculative!r}, need 'ngram' or a draft model")
    from .draft import DraftProposer

    return Speculator(DraftProposer(speculative, target, kv_cache, use_graphs), num_tokens)
