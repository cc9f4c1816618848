"""The engine: requests in, tokens out, many sequences per model step (names as in vLLM).

    engine = Engine.from_pretrained()                        # the default model, GPU if found
    outs = engine.generate(["Hello", "Tell me a joke"], SamplingParams(max_new_tokens=64))
    rid = engine.add_request("Hello", params)                # online: at any time
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.request_id, out.new_text, out.finished)
    engine.abort_request(rid)                                # its KV blocks are freed at once

Each step the Scheduler picks sequences and token counts (decodes plus prefill chunks), the
step becomes one flat Batch, the Model returns the logits of each sequence's last token, and
the sequences whose chunk reached their end get a sampled token. On the GPU a step of one
token per sequence (decode) runs through DecodeGraph instead: a CUDA graph replay that ends in
the argmax when every sequence decodes greedily, or in the sampling kernel when every sampled
sequence needs no penalty and no logprobs (its seeded uniform is copied in with the step's inputs),
so only the tokens come back to the host; steps with other rows end in the logits, sampled here.
Pipelined decode (async_decode, pipeline.py) launches the next such decode step before this one's
tokens are read; docs/serving.md gives its invariants. Verify steps of speculative decoding are in
spec_step.py, the warm-up in warm_up.py. A row whose sequence finished (end token, stop
string, abort) while its step was in flight is discarded, never appended or emitted.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from ..errors import CuinferError
from ..model.decoder import Model
from ..model.kv_cache import CacheShape, KVCache, bytes_per_token, kv_cache_dtype_for, kv_memory
from ..model.step_inputs import Batch
from ..ops import runtime
from .block_manager import BlockManager
from .detokenizer import RequestText
from .piecewise import PiecewiseForward
from .pipeline import PipelinedDecode
from .request import PromptTooLongError, RequestOutput, Stats, encode_prompt
from .runner import DecodeGraph
from .sampling import SamplingParams, draw_uniforms, graph_sampleable, sample, sampling_columns, token_logprobs
from .scheduler import Scheduler, Sequence
from .spec import make_speculator
from .spec_step import SpeculativeSteps
from .verify import Verifier
from .warm_up import warm_up

CPU_KV_TOKENS = 16384
# eager steps of up to this many tokens replay piecewise graphs (docs/serving.md); longer ones are
# GPU-bound, their host time hidden behind their kernels
PIECEWISE_MAX_TOKENS = 2048
DEFAULT_PARAMS = SamplingParams()


@dataclass(eq=False)
class _Request:
    seq: Sequence
    seed: int
    submitted: float
    text: RequestText | None  # None: the caller detokenizes (Engine.detokenize off)
    stops: frozenset  # token ids that end it, made at add_request: stop_token_ids, the end tokens unless ignore_eos
    ttft_s: float = 0.0
    prompt_logprobs: list | None = None  # filled as the prompt's chunks run; handed out once

    def output(self, new_text="", new_token_ids=(), new_logprobs=()) -> RequestOutput:
        s = self.seq
        prompt_lps, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(s.seq_id, s.prompt_ids, s.output_ids, self.text.taken if self.text else "", new_text,
                             list(new_token_ids), s.finish_reason, s.num_cached_tokens, self.ttft_s,
                             list(new_logprobs), prompt_lps)


class Engine(PipelinedDecode, SpeculativeSteps):
    def __init__(self, model: Model, kv_cache: KVCache, tokenizer=None, eos_token_ids=(),
                 max_batch_tokens: int = 512, max_num_seqs: int = 256, seed: int = 0, use_graphs: bool = True,
                 async_decode: bool = True, decoder=None, enable_prefix_caching: bool = True,
                 speculative=None, num_speculative_tokens: int = 4):
        """decoder: DecodeGraph's interface (run, read_async) for decode steps; default: a
        DecodeGraph on the GPU, none on the CPU (tests pass a stand-in, built as decoder(scratch
        block)). The decoder's scratch block is the pool's last, kept out of the block manager.
        async_decode=False never pipelines. speculative: None, "ngram" or a draft Model (same
        tokenizer), proposing up to num_speculative_tokens tokens a step (docs/speculative.md)."""
        self.model, self.kv_cache, self.tokenizer = model, kv_cache, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        if decoder is None and model.xp is not np:
            decoder = lambda scratch: DecodeGraph(model, kv_cache, scratch, use_graphs)  # noqa: E731
        managed = kv_cache.num_blocks - (decoder is not None)
        self.blocks = BlockManager(managed, kv_cache.block_size, enable_prefix_caching)
        self.decoder = decoder(managed) if decoder is not None else None
        self.piecewise = None  # eager steps on the GPU: PiecewiseForward, sharing the decode graphs' pool
        if model.xp is not np:
            shared = (self.decoder.pool, self.decoder.stream) if isinstance(self.decoder, DecodeGraph) else ()
            self.piecewise = PiecewiseForward(model, kv_cache, min(max_batch_tokens, PIECEWISE_MAX_TOKENS), *shared,
                                              use_graphs=use_graphs)
        self.async_decode = async_decode
        self._inflight = None  # _Launched, or None
        windows = model.windows  # per layer, 0: full attention
        self.scheduler = Scheduler(self.blocks, max_batch_tokens, max_num_seqs, window=min(windows) and max(windows))
        self.max_len = min(model.config.max_position_embeddings, managed * kv_cache.block_size)
        self._rng = np.random.default_rng(seed)
        self._requests = {}  # request id -> _Request, until its final output is returned
        self._ids = itertools.count()
        self.stats = Stats()
        self.spec = make_speculator(speculative, num_speculative_tokens, model, kv_cache, use_graphs)
        self.verifier = Verifier(model, kv_cache, use_graphs) if self.spec is not None else None
        # text and stop strings made here (RequestText); the AsyncEngine turns this off and makes
        # them in the server's process, aborting a request whose stop string it finds
        self.detokenize = True

    @classmethod
    def from_pretrained(cls, path=None, device=None, dtype=None, quant=None, kv_tokens=None,
                        block_size: int = 16, max_batch_tokens: int = 512, max_num_seqs: int = 256,
                        seed: int = 0, use_graphs: bool = True, async_decode: bool = True,
                        enable_prefix_caching: bool = True, speculative=None, speculative_model=None,
                        num_speculative_tokens: int = 4, kv_cache_dtype: str = "auto") -> Engine:
        """path: a checkpoint directory (None: the default model); device None: the GPU if found.
        speculative "ngram", or speculative_model (a checkpoint with the same tokenizer, loaded
        like the target: its KV cache holds as many tokens as the target's, the two sharing the
        default memory budget). kv_cache_dtype: "auto" (the model's dtype) or "fp8" (E4M3: half the
        bytes a token, so twice the tokens in the same memory); a draft model's cache follows it."""
        from ..io.checkpoint import load_checkpoint, resolve_checkpoint
        from ..io.tokenizer import Tokenizer

        kv_cache_dtype_for(kv_cache_dtype, np.float32)  # a bad name fails before anything loads
        device = runtime.pick_device(device)
        path = resolve_checkpoint(path)
        config, tensors = load_checkpoint(path)
        model = Model.from_tensors(config, tensors, device, dtype, quant)
        del tensors
        fraction = 0.8
        if speculative_model is not None:
            if speculative is not None:
                raise CuinferError("speculative: give 'ngram' or a speculative model, not both")
            draft_config, draft_tensors = load_checkpoint(resolve_checkpoint(speculative_model))
            speculative = Model.from_tensors(draft_config, draft_tensors, device, dtype)
            del draft_tensors
            # what a token takes in each cache (the draft's follows the target's kv_cache_dtype)
            per_token = [bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                         kv_cache_dtype_for(kv_cache_dtype, m.dtype))
                         for c, m in ((config, model), (draft_config, speculative))]
            fraction *= per_token[0] / sum(per_token)
        shape = CacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size)
        if device == "cpu" and kv_tokens is None:
            kv_tokens = CPU_KV_TOKENS
        cache = KVCache.allocate(shape, kv_cache_dtype_for(kv_cache_dtype, model.dtype), model.xp, kv_tokens,
                                 memory_fraction=fraction)
        tok = Tokenizer.from_pretrained(path)
        return cls(model, cache, tok, tok.eos_token_ids, max_batch_tokens, max_num_seqs, seed=seed,
                   use_graphs=use_graphs, async_decode=async_decode, enable_prefix_caching=enable_prefix_caching,
                   speculative=speculative, num_speculative_tokens=num_speculative_tokens)

    def warm_up(self) -> dict:
        """Run every kind of step once before the first request, as a server does at start (see
        warm_up.warm_up): nothing compiled or captured while a request waits. Returns {"seconds",
        "graphs", "graph_mib"}."""
        return warm_up(self)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt) -> list:
        """A prompt as token ids (encode_prompt with this engine's tokenizer)."""
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, prompt, params: SamplingParams = DEFAULT_PARAMS, request_id=None) -> str:
        """Queue a prompt (a string or token ids) at any time; the next step() may run it."""
        ids = self.encode(prompt)
        if not ids:
            raise CuinferError("prompt: empty, need at least one token")
        if len(ids) >= self.max_len:
            raise PromptTooLongError(f"prompt: {len(ids)} tokens, the context holds {self.max_len} "
                                     f"(room for at least one new token needed)")
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise CuinferError(f"request id {rid!r} is in use")
        seq = Sequence(rid, ids, params, match_prefix=params.prompt_logprobs is None)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
        text = RequestText(self.tokenizer, params.stop) if self.detokenize else None
        self.scheduler.add(seq)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self._requests[rid] = _Request(seq, seed, time.perf_counter(), text, stops,
                                       prompt_logprobs=None if params.prompt_logprobs is None else [None])
        self.stats.prompt_tokens += len(ids)
        return rid

    def abort_request(self, request_id) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored. A row of
        it in a step in flight is discarded when that step is read."""
        req = self._requests.pop(str(request_id), None)
        if req is not None and req.seq.finish_reason is None:
            self.scheduler.abort(req.seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks held by live requests (cached free blocks count as free)."""
        return self.blocks.usage()

    # ---------------------------------------------------------------------- step

    def step(self) -> list:
        """Run one model step; [RequestOutput] of the requests that got a token. A finished
        request's output is its last: the engine forgets it then."""
        if not self.scheduler.has_work():
            if self._inflight is not None:  # every row of it was aborted
                self._resolve(self._inflight)
                self._inflight = None
            return []
        t0 = time.perf_counter()
        if self._inflight is None:
            preempted = self.scheduler.num_preemptions
            plan = self.scheduler.schedule()
            if not plan:
                raise CuinferError("the scheduler found nothing to run: the KV cache is too small")
            self.stats.preemptions += self.scheduler.num_preemptions - preempted
            self._note_kv_blocks()
            if self._verifies(plan):
                return self._spec_step(plan, t0)
            if not self._launches(plan):
                return self._sync_step(plan, t0)
            self._inflight = self._launch([s for s, _ in plan], None)
            self._begin(self._inflight)
        return self._pipelined_step(t0)

    def _decode_tokens(self, seqs, token_ids, device_tokens=None):
        """A decode step on the decoder whose rows all make their token in the graph: the device
        int32 tokens. Greedy when every row is, else sampled with each row's seeded uniform."""
        args = (token_ids, [s.num_computed for s in seqs], [s.block_table for s in seqs])
        if all(s.params.greedy for s in seqs):
            return self.decoder.run(*args, True, device_tokens=device_tokens)
        columns = sampling_columns([s.params for s in seqs], self._uniforms(seqs))
        return self.decoder.run(*args, False, device_tokens=device_tokens, sampling=columns)

    def _uniforms(self, seqs) -> np.ndarray:
        """Each sequence's uniform for its next token: draw_uniforms(seed, output length), 0 if greedy."""
        u = draw_uniforms([self._requests[s.seq_id].seed for s in seqs], [len(s.output_ids) for s in seqs])
        return np.where([s.params.greedy for s in seqs], 0.0, u)

    def _note_kv_blocks(self) -> None:
        self.stats.peak_kv_blocks = max(self.stats.peak_kv_blocks, self.blocks.num_blocks - self.blocks.num_free)

    def _sync_step(self, plan, t0) -> list:
        """The step run and read back before returning (everything but pipelined decode)."""
        tokens, logits = self._run_model(plan)
        for s, n in plan:
            self.scheduler.computed(s, n)
        ready = [i for i, (s, _) in enumerate(plan) if s.num_computed == s.num_tokens]
        events = []
        if ready:
            seqs = [plan[i][0] for i in ready]
            reqs = [self._requests[s.seq_id] for s in seqs]
            lps = [None] * len(ready)
            if tokens is None:
                tokens, lps = self._sample(seqs, logits[self.model.xp.asarray(np.asarray(ready, dtype=np.int64))])
            else:
                tokens = tokens[ready]
            now = time.perf_counter()
            events = [self._append(r, int(t), now, lp) for r, t, lp in zip(reqs, tokens, lps)]
        elapsed = time.perf_counter() - t0
        prompt_tokens = sum(n for s, n in plan if n > 1 or s.num_computed <= len(s.prompt_ids))
        if prompt_tokens:
            self.stats.prefill_s += elapsed
            self.stats.prefill_tokens += prompt_tokens
        else:
            self.stats.decode_s += elapsed
            self.stats.decode_tokens += len(events)
            if self.spec is not None:
                self.spec.note_plain_step(len(plan), elapsed)
        return events

    def _sample(self, seqs, logits):
        """(tokens, logprobs entries) of seqs from their rows of float32 logits [len(seqs), vocab]:
        penalties, sampling and uniforms as every plain step draws them."""
        params = [s.params for s in seqs]
        histories = [s.token_ids if p.repetition_penalty != 1 else () for s, p in zip(seqs, params)]
        outputs = [s.output_ids if p.presence_penalty or p.frequency_penalty else () for s, p in zip(seqs, params)]
        return sample(logits, params, histories, self._uniforms(seqs), outputs, with_logprobs=True)


    def _append_all(self, req: _Request, tokens, logprobs, now: float) -> RequestOutput:
        """Append a step's tokens one by one until the sequence finishes (the rest are dropped); one
        RequestOutput with all of them (logprobs: an entry per token, or None)."""
        n = 0
        for t in tokens:
            n += 1
            if self._push(req, t, now):
                break
        new = req.text.take(final=req.seq.finish_reason is not None) if req.text is not None else ""
        return req.output(new, tokens[:n], [e for e in logprobs[:n] if e is not None] if logprobs else [])

    def _run_model(self, plan):
        """(host tokens, None) when the decoder made the step's tokens (argmax or sampling in the
        graph), else (None, float32 logits [num_seqs, vocab] on the model's device)."""
        want = [i for i, (s, n) in enumerate(plan) if self._wants_prompt_logprobs(s, n)]
        if self.decoder is not None and all(n == 1 for _, n in plan) and not want:
            seqs = [s for s, _ in plan]
            token_ids = [s.token_at(s.num_computed) for s in seqs]
            if all(graph_sampleable(s.params) for s in seqs):
                return self._decode_tokens(seqs, token_ids).get(), None
            return None, self.decoder.run(token_ids, [s.num_computed for s in seqs], [s.block_table for s in seqs],
                                          False)
        # prefill chunks first, one-token sequences last (Batch.decodes: the decode kernel attends them)
        order = sorted(range(len(plan)), key=lambda i: plan[i][1] == 1)
        inv = np.argsort(order)  # plan[i] is the step's sequence inv[i]
        plan, want = [plan[i] for i in order], [int(inv[i]) for i in want]
        chunks = [(s.token_slice(s.num_computed, s.num_computed + n), s.num_computed, s.block_table)
                  for s, n in plan]
        batch = Batch.from_chunks(chunks, self.kv_cache.block_size).to(self.model.xp)
        if not want:
            logits = self._forward(batch)
            return None, logits if order == sorted(order) else logits[self.model.xp.asarray(inv)]
        logits = self._forward(batch, all_logits=True)  # logits: [tokens, vocab]
        ends = np.cumsum([n for _, n in plan])
        self._prompt_logprobs([plan[i] for i in want], ends[want] - [plan[i][1] for i in want], logits)
        return None, logits[self.model.xp.asarray((ends - 1)[inv])]

    def _forward(self, batch, all_logits: bool = False):
        """Model.forward of an eager step, through the piecewise graphs on the GPU."""
        if self.piecewise is None:
            return self.model.forward(batch, self.kv_cache, all_logits)
        return self.piecewise.forward(batch, all_logits)

    def _wants_prompt_logprobs(self, seq, n: int) -> bool:
        """Whether seq's chunk of n tokens predicts prompt tokens whose logprobs it still lacks."""
        if seq.params.prompt_logprobs is None:  # every decode step asks: answer without a lookup
            return False
        lps = self._requests[seq.seq_id].prompt_logprobs
        return lps is not None and len(lps) < min(seq.num_computed + n + 1, len(seq.prompt_ids))

    def _prompt_logprobs(self, plan, starts, logits):
        """Append to each (sequence, n) of `plan` the logprobs of the prompt tokens its chunk's rows
        (from starts[i] in logits) predict and it lacks (a recomputed chunk adds nothing): row j gives
        the token at position num_computed + j + 1."""
        rows, nxt, owners = [], np.zeros(len(logits), np.int64), []
        for (s, n), r0 in zip(plan, starts):
            have = len(self._requests[s.seq_id].prompt_logprobs)
            for j in range(n):
                p = s.num_computed + j + 1  # the token this row predicts
                if have <= p < len(s.prompt_ids):
                    rows.append(int(r0) + j)
                    nxt[int(r0) + j] = s.prompt_ids[p]
                    owners.append(s)
        entries = token_logprobs(logits, nxt, rows, [s.params.prompt_logprobs for s in owners], self.model.xp)
        for s, entry in zip(owners, entries):
            self._requests[s.seq_id].prompt_logprobs.append(entry)

    def _append(self, req: _Request, token: int, now: float, logprob=None) -> RequestOutput:
        return self._append_all(req, [token], [logprob], now)

    def _push(self, req: _Request, token: int, now: float) -> bool:
        """Append one token to the request's sequence and text; whether that finished it (an end or
        stop token, a stop string, max_new_tokens, the context)."""
        seq, p = req.seq, req.seq.params
        if seq.num_known == len(seq.prompt_ids):
            req.ttft_s = now - req.submitted
            if self.stats.generated_tokens == 0:
                self.stats.ttft_s = req.ttft_s
            self.stats.cached_tokens += seq.num_cached_tokens
        self.scheduler.append(seq, token)
        self.stats.generated_tokens += 1
        reason = None
        if token in req.stops:
            reason = "stop"
        elif req.text is not None and req.text.push(token):
            reason = "stop"  # a stop string
        elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._requests[seq.seq_id]
        return reason is not None

    # ------------------------------------------------------------------ batches

    def stream(self, prompts, params=DEFAULT_PARAMS):
        """Yield (prompt index, new text) as tokens arrive; self.outputs holds the RequestOutputs at
        the end and self.stats the numbers of this call. prompts: a string, token ids, or a list of
        them; params: one SamplingParams or one per prompt. Stopping the iteration early aborts
        the requests it added."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) \
            else list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise CuinferError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        self.stats = Stats()
        ids = []
        try:
            for p, pp in zip(prompts, plist):
                ids.append(self.add_request(p, pp))
            index = {rid: i for i, rid in enumerate(ids)}
            final = {}
            while len(final) < len(ids):
                for out in self.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    if out.finished:
                        final[i] = out
                    if out.new_text:
                        yield i, out.new_text
        finally:
            for rid in ids:
                self.abort_request(rid)
        self.outputs = [final[i] for i in range(len(ids))]
        lens = [len(o.prompt_ids) + len(o.token_ids) for o in self.outputs]
        self.stats.kv = kv_memory(lens, self.kv_cache.block_size, self.kv_cache.token_bytes,
                                  self.model.config.max_position_embeddings)

    def generate(self, prompts, params=DEFAULT_PARAMS) -> list:
        """Run every prompt to completion; [RequestOutput] in prompt order (see stream)."""
        for _ in self.stream(prompts, params):
            pass
        return self.outputs
