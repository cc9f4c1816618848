"""Token sampling over a batch of logits, on the device that holds them.

sample(logits, params, histories, uniforms, outputs) -> int64 [num_seqs]
    logits: float32 [num_seqs, vocab] (numpy or cupy: the same array-module code runs on both)
    params: one SamplingParams per row; histories: the token ids each row has seen (prompt and
    output, for the repetition penalty); uniforms: float [num_seqs] in [0, 1), one draw per row;
    outputs: each row's generated ids (presence and frequency penalties).

After the penalties every row goes through ops.sampling (its NumPy reference on the host, its
kernel on the device: the same tokens, bit for bit): rows with temperature 0 take the argmax;
sampled rows go through temperature, top-k, top-p (of the top-k mass) and min-p in Hugging Face's
order, tokens ranked by descending logit (ties: the lower id first), and pick a token by inverting
the CDF of integer weights (trunc(p * 2^31), so that its sums are exact in any order) at the row's
uniform; cuinfer/ops/sampling.py defines each rounding. The uniform comes from `draw_uniform(seed,
step)`: a request with a seed gets the same tokens whatever batch it runs in and however often it
is preempted. Decode steps whose rows need no penalty and no logprobs (graph_sampleable) run the
same kernel inside the step's CUDA graph (serving/runner.py) with the same uniforms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ops import runtime
from ..ops.sampling import sampling as ops_sampling


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already seen (CTRL / HF rule)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated (OpenAI)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated (OpenAI)
    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its prefix is then recomputed)
    seed: int | None = None
    stop: tuple = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple = ()  # extra to the model's end-of-sequence tokens
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                  ("temperature", 0 <= self.temperature < math.inf, ">= 0 and finite"),
                  ("seed", self.seed is None or 0 <= self.seed < 2 ** 63, "in [0, 2**63)"),
                  ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
                  ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                  ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "None or in [0, 20]"),
                  ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                   "None or in [0, 20]")]
        for name, ok, need in checks:
            if not ok:
                raise runtime.CuinferError(f"{name}: got {getattr(self, name)}, need {need}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z):
    """SplitMix64's finalizer (a bijection of uint64 with full avalanche), on uint64 arrays."""
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX[0]
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX[1]
    return z ^ (z >> np.uint64(31))


def draw_uniforms(seeds, steps) -> np.ndarray:
    """float64 [n]: the uniform in [0, 1) each request (seed) uses for its step-th token, 53 random
    bits of mix(mix(seed + golden) ^ step): a counter-based draw, a few microseconds a batch (a
    numpy Generator a row took ~30-60 us, a decode step's host time at large batches)."""
    with np.errstate(over="ignore"):
        seeds = np.asarray(seeds, dtype=np.uint64)
        z = _mix64(_mix64(seeds + _GOLDEN) ^ np.asarray(steps, dtype=np.uint64))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def draw_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) a request with this seed uses for its step-th token (draw_uniforms)."""
    return float(draw_uniforms([seed], [step])[0])


def apply_repetition_penalty(logits, histories, penalties, xp):
    """Divide positive logits of seen tokens by the penalty, multiply negative ones (in place)."""
    rows = [i for i, p in enumerate(penalties) if p != 1.0 and histories[i]]
    if not rows:
        return logits
    vocab = logits.shape[1]
    flat_idx = np.concatenate([i * vocab + np.unique(np.asarray(histories[i], dtype=np.int64))
                               for i in rows])
    pen = np.concatenate([np.full(len(np.unique(histories[i])), penalties[i], np.float32) for i in rows])
    flat_idx, pen = xp.asarray(flat_idx), xp.asarray(pen)
    flat = logits.reshape(-1)
    seen = flat[flat_idx]
    flat[flat_idx] = xp.where(seen > 0, seen / pen, seen * pen)
    return logits


def apply_presence_frequency(logits, outputs, presence, frequency, xp):
    """OpenAI's penalties over each row's generated tokens (in place): a token generated c times
    loses frequency * c + presence from its logit."""
    rows = [i for i in range(len(outputs)) if (presence[i] or frequency[i]) and len(outputs[i])]
    if not rows:
        return logits
    vocab = logits.shape[1]
    counted = [np.unique(np.asarray(outputs[i], dtype=np.int64), return_counts=True) for i in rows]
    flat_idx = np.concatenate([i * vocab + ids for i, (ids, _) in zip(rows, counted)])
    minus = np.concatenate([frequency[i] * c + presence[i] for i, (_, c) in zip(rows, counted)]).astype(np.float32)
    flat = logits.reshape(-1)
    flat[xp.asarray(flat_idx)] -= xp.asarray(minus)
    return logits


def token_logprobs(logits, tokens, rows, ks, xp) -> list:
    """[(logprob of the row's token, [(token, logprob)] of its ks[j] most likely)] for the given rows
    of float32 logits [n, vocab]: log_softmax, in float32 on the logits' device."""
    sel = xp.asarray(np.asarray(rows, dtype=np.int64))
    x = logits[sel]
    m = x.max(axis=-1, keepdims=True)
    lp = x - (m + xp.log(xp.exp(x - m).sum(axis=-1, keepdims=True)))  # lp: [rows, vocab]
    chosen = xp.take_along_axis(lp, xp.asarray(tokens)[sel][:, None], axis=-1)[:, 0]
    k = max(ks)
    top = xp.argsort(-lp, axis=-1)[:, :k]
    top_lp = xp.take_along_axis(lp, top, axis=-1)
    host = (lambda a: a.get()) if xp is not np else (lambda a: a)
    chosen, top, top_lp = host(chosen), host(top), host(top_lp)
    return [(float(chosen[j]), [(int(t), float(v)) for t, v in zip(top[j, :kj], top_lp[j, :kj])])
            for j, kj in enumerate(ks)]


def filtered_probs(logits, temperature, top_k, top_p, min_p, xp):
    """(order, p, keep): each row's token ids by descending logit [n, vocab] and, in that order, the
    unnormalised probabilities after temperature, top-k, top-p (of the top-k mass) and min-p, the
    filtered tokens at 0 (the distribution sample_rows draws from), and the mask of those kept."""
    _n, vocab = logits.shape
    order = xp.argsort(-logits, axis=-1)  # order: [n, vocab], largest logit first
    z = xp.take_along_axis(logits, order, axis=-1) / temperature[:, None]
    p = xp.exp(z - z[:, :1])  # p: [n, vocab] unnormalised, sorted descending, p[:, 0] = 1
    rank = xp.arange(vocab)[None, :]
    k = xp.where(top_k > 0, top_k, vocab)
    keep = rank < k[:, None]  # top-k
    p = xp.where(keep, p, 0)
    c = xp.cumsum(p, axis=-1)
    keep &= (c - p) < top_p[:, None] * c[:, -1:]  # top-p: the tokens before this one hold < top_p
    keep &= p >= min_p[:, None]  # min-p: p / p_max >= min_p, p_max = 1 here
    return order, xp.where(keep, p, 0), keep


def sample_rows(logits, temperature, top_k, top_p, min_p, uniforms, xp):
    """One token per row of float32 logits [n, vocab] with per-row parameters ([n] arrays; temperature
    0: the argmax): ops.sampling, its NumPy reference on the host, its kernel on the device (the same
    tokens); int64 [n] on the logits' device."""
    col = lambda a, dt: xp.ascontiguousarray(xp.asarray(a).astype(dt, copy=False))
    return ops_sampling(xp.ascontiguousarray(logits), col(temperature, np.float32), col(top_k, np.int32),
                        col(top_p, np.float32), col(min_p, np.float32), col(uniforms, np.float32)).astype(np.int64)


def sampling_columns(params, uniforms) -> tuple:
    """(temperature, top_k, top_p, min_p, uniforms): host [n] float32 / int32 / float32 / float32 /
    float32 columns of ops.sampling's per-row parameters (greedy rows: temperature 0)."""
    return (np.asarray([p.temperature for p in params], dtype=np.float32),
            np.asarray([p.top_k for p in params], dtype=np.int32),
            np.asarray([p.top_p for p in params], dtype=np.float32),
            np.asarray([p.min_p for p in params], dtype=np.float32),
            np.asarray(uniforms, dtype=np.float32))


def graph_sampleable(params) -> bool:
    """Whether ops.sampling alone gives the row's token (no penalties, no logprobs): such rows'
    decode steps end in the sampling kernel inside the CUDA graph (serving/runner.py)."""
    return (params.repetition_penalty == 1 and not params.presence_penalty and not params.frequency_penalty
            and params.logprobs is None)


def token_probs(logits, params):
    """float64 host [n, vocab]: the distribution `sample` draws each row's token from, without the
    penalties (speculative decoding runs no row that has them); greedy rows are one-hot at the argmax."""
    xp = runtime.require_cupy() if runtime.is_device_array(logits) else np
    logits = logits.astype(np.float32)
    n, vocab = logits.shape
    col = lambda name, dt: xp.asarray(np.asarray([1 if p.greedy else getattr(p, name) for p in params], dtype=dt))
    order, p, _ = filtered_probs(logits, col("temperature", np.float32), col("top_k", np.int64),
                                 col("top_p", np.float32), col("min_p", np.float32), xp)
    out = xp.zeros((n, vocab), dtype=np.float64)
    out.reshape(-1)[(order + xp.arange(n)[:, None] * vocab).reshape(-1)] = p.reshape(-1)  # back to vocab order
    top = xp.argmax(logits, axis=-1)
    host = (lambda a: a.get()) if xp is not np else (lambda a: a)
    out, top = host(out), host(top)
    out /= out.sum(axis=-1, keepdims=True)
    for i, q in enumerate(params):
        if q.greedy:
            out[i] = 0.0
            out[i, top[i]] = 1.0
    return out


def sample(logits, params, histories, uniforms, outputs=None, with_logprobs=False):
    """Next token per row (int64 array on the host); with_logprobs: (tokens, [None, or per row that
    asks (SamplingParams.logprobs), token_logprobs' entry]), logprobs of the logits after the
    penalties, before temperature. outputs: each row's generated tokens (presence/frequency)."""
    xp = runtime.require_cupy() if runtime.is_device_array(logits) else np
    logits = logits.astype(np.float32, copy=True)
    logits = apply_repetition_penalty(logits, histories, [p.repetition_penalty for p in params], xp)
    if outputs is not None:
        logits = apply_presence_frequency(logits, outputs, [p.presence_penalty for p in params],
                                          [p.frequency_penalty for p in params], xp)
    tokens = sample_rows(logits, *sampling_columns(params, uniforms), xp)
    host = tokens.get() if xp is not np else tokens
    if not with_logprobs:
        return host
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    lps = [None] * len(params)
    if lp_rows:
        found = token_logprobs(logits, tokens, lp_rows, [params[i].logprobs for i in lp_rows], xp)
        for i, entry in zip(lp_rows, found):
            lps[i] = entry
    return host, lps
