"""The engine: requests in, tokens out, many sequences per model step.

    engine = Engine.from_pretrained(path, device="gpu")
    outputs = engine.generate(["Hello", "Tell me a joke"], SamplingParams(max_new_tokens=64))
    for index, text in engine.stream(prompts, params): ...

Each step the Scheduler picks sequences and token counts (decodes plus prefill
chunks), the step becomes one flat Batch, the Model returns the logits of each
sequence's last token, and the sequences whose chunk reached their end get a
sampled token. Finished sequences free their KV blocks; waiting ones take them.
On the GPU a step of one token per sequence (decode) runs through DecodeGraph instead:
a CUDA graph replay (use_graphs=False: the same step eagerly) that ends in the argmax when
every sequence decodes greedily, so only the tokens come back to the host.

Pipelined decode (async_decode=True, the default; GPU decoder only; H100, batch 1: +3.7% tok/s
on llama3-8b fp16, +8% on the default model, notes/decode.md). A greedy all-decode step is
launched and its tokens copied to pinned host memory asynchronously. If the next step would run
exactly the same sequences, in the same order, again all greedy decodes (the steady state: nothing
to prefill, admit or preempt, no sequence certain to finish on this token by max_new_tokens or the
context), the next step is launched BEFORE this one's tokens are read: its input tokens are this
step's device output (DecodeGraph.run's device_tokens), so the host work of reading, appending,
stopping and scheduling overlaps the GPU's next step. At most one step is in flight between step()
calls, and every step() call still returns the events of exactly one model step. Invariants:

* A sequence in the in-flight step is bookkept as if that step were done with its token unknown:
  num_computed counts the position it decodes and output_ids ends with PENDING (-1). The scheduler
  sees only lengths, so it reserves the next KV slot correctly. Nothing reads PENDING: the next
  step's input token comes from the device, and every other path (prefill chunks, sampling,
  repetition penalty, outputs) runs only when nothing is in flight. Resolving the step replaces
  PENDING by the real token through _append, exactly as the synchronous path appends it.
* When a resolved token finishes a sequence on its value (end token, stop id, stop string), the
  in-flight step has computed one more token for it: that row is discarded (never appended or
  emitted). The sequence's KV blocks are freed on the host at once although the in-flight step
  still writes its slot: every later GPU step (graph replays, eager decodes, prefills) is
  enqueued after it on the same (current) stream, and a graph capture synchronizes the device
  first, so whoever reuses those blocks writes them after it.
* Only data-dependent stops waste a token. While requests wait for admission, a sequence that may
  stop on its data ends pipelining: its finish could free the room that admits a waiting request,
  and the synchronous engine would admit it one step earlier. So the scheduler makes the same
  decisions as without pipelining, and the outputs are the same.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..model.decoder import Batch, Model
from ..model.kv_cache import CacheShape, KVCache, kv_memory
from ..ops import runtime
from .runner import DecodeGraph
from .sampling import SamplingParams, draw_uniform, sample
from .scheduler import Scheduler, Sequence

CPU_KV_TOKENS = 16384
DEFAULT_PARAMS = SamplingParams()
PENDING = -1  # output_ids placeholder: a token still on the device (see "Pipelined decode" above)


class PromptTooLongError(runtime.CuinferError):
    pass


@dataclass
class Output:
    prompt_ids: list
    token_ids: list
    text: str
    finish_reason: str  # "stop" (end token or stop string) or "length"
    ttft_s: float = 0.0


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0  # first request: submission to its first token
    prefill_s: float = 0.0  # steps that carried prompt tokens
    prefill_tokens: int = 0
    decode_s: float = 0.0  # steps of decodes only (mixed steps count as prefill)
    decode_tokens: int = 0  # tokens sampled in those steps
    preemptions: int = 0
    pipelined_steps: int = 0  # decode steps launched before the previous step's tokens were read
    peak_kv_blocks: int = 0
    kv: dict = field(default_factory=dict)  # kv_memory() of the finished sequences


@dataclass(eq=False)
class _Request:
    index: int
    seq: Sequence
    seed: int
    submitted: float
    decoder: object = None  # tokenizer stream: token id -> new text
    text: str = ""
    emitted: int = 0  # characters already handed to the caller
    ttft_s: float = 0.0


@dataclass(eq=False)
class _Launched:
    """A greedy decode step launched on the device whose tokens the host has not read yet."""
    seqs: list  # its rows, in order; a row whose sequence finished meanwhile is discarded
    tokens: object  # device int32 [rows]: the input tokens of the step pipelined after it
    pending: object  # PendingTokens: wait() -> the tokens as ints


class Engine:
    def __init__(self, model: Model, kv_cache: KVCache, tokenizer=None, eos_token_ids=(),
                 max_batch_tokens: int = 512, max_num_seqs: int = 256, seed: int = 0, use_graphs: bool = True,
                 async_decode: bool = True, decoder=None):
        """decoder: DecodeGraph's interface (run, read_async) for decode steps; default: a
        DecodeGraph on the GPU, none on the CPU (tests pass a stand-in). async_decode=False never
        pipelines: every greedy decode step reads its tokens back before the next is scheduled."""
        self.model, self.kv_cache, self.tokenizer = model, kv_cache, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        if decoder is None and model.xp is not np:
            decoder = DecodeGraph(model, kv_cache, use_graphs)
        self.decoder, self.async_decode = decoder, async_decode
        self._inflight = None  # _Launched, or None
        self.scheduler = Scheduler(kv_cache.allocator, kv_cache.block_size, max_batch_tokens, max_num_seqs)
        free_tokens = kv_cache.allocator.num_free * kv_cache.block_size  # the decoder's scratch block is taken
        self.max_len = min(model.config.max_position_embeddings, free_tokens)
        self._rng = np.random.default_rng(seed)
        self._requests = {}
        self._next_id = 0
        self.stats = Stats()

    @classmethod
    def from_pretrained(cls, path=None, device="gpu", dtype=None, quant=None, kv_tokens=None,
                        block_size: int = 16, max_batch_tokens: int = 512, seed: int = 0,
                        use_graphs: bool = True, async_decode: bool = True) -> Engine:
        from ..io.checkpoint import load_checkpoint
        from ..io.tokenizer import Tokenizer

        if path is None:
            from ..io.default_model import default_model_dir

            path = default_model_dir()
        if device == "gpu":
            cp = runtime.require_cupy()
            try:
                found = cp.cuda.runtime.getDeviceCount() > 0
            except cp.cuda.runtime.CUDARuntimeError:
                found = False
            if not found:
                raise runtime.NoDeviceError("no CUDA device found: use --device cpu")
        elif device != "cpu":
            raise runtime.CuinferError(f"device: got {device!r}, need 'gpu' or 'cpu'")
        config, tensors = load_checkpoint(path)
        model = Model.from_tensors(config, tensors, device, dtype, quant)
        del tensors
        shape = CacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size)
        if device == "cpu" and kv_tokens is None:
            kv_tokens = CPU_KV_TOKENS
        cache = KVCache.allocate(shape, model.dtype, model.xp, kv_tokens)
        tok = Tokenizer.from_pretrained(path)
        return cls(model, cache, tok, tok.eos_token_ids, max_batch_tokens, seed=seed, use_graphs=use_graphs,
                   async_decode=async_decode)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt) -> list:
        """A prompt as token ids: a list of ints is taken as is, a string goes through the tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise runtime.CuinferError("this engine has no tokenizer: pass prompts as token id lists")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams, index: int = 0) -> Sequence:
        """Queue a prompt; step() runs it (stream and generate call both)."""
        ids = self.encode(prompt)
        if not ids:
            raise runtime.CuinferError("prompt: empty, need at least one token")
        if len(ids) >= self.max_len:
            raise PromptTooLongError(f"prompt: {len(ids)} tokens, the context holds {self.max_len} "
                                     f"(room for at least one new token needed)")
        seq = Sequence(self._next_id, ids, params)
        self._next_id += 1
        seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
        decoder = self.tokenizer.stream() if self.tokenizer is not None else None
        self._requests[seq.seq_id] = _Request(index, seq, seed, time.perf_counter(), decoder)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)
        return seq

    # ---------------------------------------------------------------------- step

    def step(self) -> list:
        """Run one model step; returns [(request, new text, finished)] for sequences that got a token.
        With pipelined decode the step whose tokens this returns may have been launched by the
        previous call, and the next one may be left running on the device (module docstring)."""
        t0 = time.perf_counter()
        if self._inflight is None:
            preempted = self.scheduler.num_preemptions
            plan = self.scheduler.schedule()
            if not plan:
                raise runtime.CuinferError("the scheduler found nothing to run: the KV cache is too small")
            self.stats.preemptions += self.scheduler.num_preemptions - preempted
            self._note_kv_blocks()
            if not self._launches(plan):
                return self._sync_step(plan, t0)
            self._inflight = self._launch([s for s, _ in plan], None)
            self._begin(self._inflight)
        current, following = self._inflight, None
        if self._may_pipeline(current.seqs):  # the next step's KV slots are now reserved
            following = self._launch(current.seqs, current.tokens)
            self.stats.pipelined_steps += 1
            self._note_kv_blocks()
        self._inflight = None
        events = self._resolve(current)
        self._inflight = following
        if self._inflight is not None:
            self._begin(self._inflight)
            if all(s.finish_reason is not None for s in self._inflight.seqs):
                # all its rows are discarded: resolve it now, so that a step is in flight only while
                # the scheduler has work (callers loop on scheduler.has_work())
                self._resolve(self._inflight)
                self._inflight = None
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_tokens += len(events)
        return events

    def _launches(self, plan) -> bool:
        """Whether the step goes through _launch: on the decoder, every sequence greedy and decoding
        (one token past its prompt that yields its next token; a prompt's last token is prefill)."""
        return (self.async_decode and self.decoder is not None
                and all(n == 1 and s.remaining == 1 and s.num_computed >= len(s.prompt_ids) for s, n in plan)
                and all(s.params.greedy and s.params.repetition_penalty == 1 for s, _ in plan))

    def _may_pipeline(self, seqs) -> bool:
        """Whether the step after `seqs`' in-flight step may be launched before its tokens are read
        (module docstring); if so, the scheduler has reserved its KV slots. Host logic only."""
        waiting = bool(self.scheduler.waiting)
        for s in seqs:
            if s.finish_reason is not None:
                return False
            p = s.params
            if len(s.output_ids) >= p.max_new_tokens or s.num_tokens >= self.max_len:
                return False  # the pending token is its last: no step after it
            if waiting and (p.stop_token_ids or p.stop or (self.eos_token_ids and not p.ignore_eos)):
                return False  # its finish could admit a waiting request: decide on the real tokens
        return self.scheduler.reserve_decodes(seqs)

    def _launch(self, seqs, device_tokens) -> _Launched:
        """Launch a greedy decode step of `seqs` at their num_computed positions; the input tokens are
        device_tokens (the previous step's output, rows in the same order) or, when None, the
        sequences' own tokens (then none may be PENDING). Nothing is read back or waited for."""
        if device_tokens is None:
            token_ids = [s.token_at(s.num_computed) for s in seqs]
            assert PENDING not in token_ids, "a pending token was read on the host"
        else:
            token_ids = [0] * len(seqs)  # replaced on the device
        out = self.decoder.run(token_ids, [s.num_computed for s in seqs], [s.block_table for s in seqs], True,
                               device_tokens=device_tokens)
        return _Launched(list(seqs), out, self.decoder.read_async(out))

    @staticmethod
    def _begin(launched: _Launched) -> None:
        """Bookkeep a launched step as done with its tokens unknown (rows of finished sequences are
        left out: their tokens will be discarded)."""
        for s in launched.seqs:
            if s.finish_reason is None:
                s.num_computed += 1
                s.output_ids.append(PENDING)

    def _resolve(self, launched: _Launched) -> list:
        """Wait for a launched step's tokens (its copy's event only) and append them in place of the
        PENDING placeholders; rows of sequences finished by an earlier token are discarded."""
        tokens = launched.pending.wait()
        now = time.perf_counter()
        events = []
        for s, t in zip(launched.seqs, tokens):
            if s.finish_reason is not None:
                continue  # the extra token computed after a data-dependent stop
            assert s.output_ids[-1] == PENDING
            s.output_ids.pop()
            # A finish frees the blocks at once, though a step pipelined after this one may still
            # write the sequence's next slot: GPU work that could reuse them is enqueued later on
            # the same stream (a graph capture synchronizes the device first), so it runs after.
            events.append(self._append(self._requests[s.seq_id], int(t), now))
        return events

    def _note_kv_blocks(self) -> None:
        alloc = self.kv_cache.allocator
        self.stats.peak_kv_blocks = max(self.stats.peak_kv_blocks, alloc.num_blocks - alloc.num_free)

    def _sync_step(self, plan, t0) -> list:
        """The step run and read back before returning (everything but pipelined decode)."""
        tokens, logits = self._run_model(plan)
        for s, n in plan:
            s.num_computed += n
        ready = [i for i, (s, _) in enumerate(plan) if s.num_computed == s.num_tokens]
        events = []
        if ready:
            seqs = [plan[i][0] for i in ready]
            reqs = [self._requests[s.seq_id] for s in seqs]
            params = [s.params for s in seqs]
            histories = [s.token_ids if p.repetition_penalty != 1 else () for s, p in zip(seqs, params)]
            uniforms = [0.0 if p.greedy else draw_uniform(r.seed, len(s.output_ids))
                        for r, s, p in zip(reqs, seqs, params)]
            if tokens is None:
                rows = logits[self.model.xp.asarray(np.asarray(ready, dtype=np.int64))]
                tokens = sample(rows, params, histories, uniforms)
            else:
                tokens = tokens[ready]
            now = time.perf_counter()
            events = [self._append(r, int(t), now) for r, t in zip(reqs, tokens)]
        elapsed = time.perf_counter() - t0
        prompt_tokens = sum(n for s, n in plan if n > 1 or s.num_computed <= len(s.prompt_ids))
        if prompt_tokens:
            self.stats.prefill_s += elapsed
            self.stats.prefill_tokens += prompt_tokens
        else:
            self.stats.decode_s += elapsed
            self.stats.decode_tokens += len(events)
        return events

    def _run_model(self, plan):
        """(host argmax tokens, None) when the decoder took the step greedily, else (None, float32
        logits [num_seqs, vocab] on the model's device)."""
        if self.decoder is not None and all(n == 1 for _, n in plan):
            greedy = all(s.params.greedy and s.params.repetition_penalty == 1 for s, _ in plan)
            out = self.decoder.run([s.token_at(s.num_computed) for s, _ in plan],
                                   [s.num_computed for s, _ in plan], [s.block_table for s, _ in plan], greedy)
            return (out.get(), None) if greedy else (None, out)
        chunks = [(s.token_ids[s.num_computed:s.num_computed + n], s.num_computed, s.block_table)
                  for s, n in plan]
        batch = Batch.from_chunks(chunks, self.kv_cache.block_size).to(self.model.xp)
        return None, self.model.forward(batch, self.kv_cache)

    def _append(self, req: _Request, token: int, now: float):
        seq, p = req.seq, req.seq.params
        if not seq.output_ids:
            req.ttft_s = now - req.submitted
            if self.stats.generated_tokens == 0:
                self.stats.ttft_s = req.ttft_s
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        reason = None
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        if token in stops:
            reason = "stop"
        else:
            if req.decoder is not None:
                req.text += req.decoder.push(token)
            cut = min((i for i in (req.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.text, reason = req.text[:cut], "stop"
            elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_len:
                reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        hold = 0 if reason else max((len(s) for s in p.stop), default=1) - 1
        upto = max(req.emitted, len(req.text) - hold)
        new, req.emitted = req.text[req.emitted:upto], upto
        return req, new, reason is not None

    # ------------------------------------------------------------------ batches

    def stream(self, prompts, params: SamplingParams = DEFAULT_PARAMS):
        """Yield (prompt index, new text) as tokens arrive; self.outputs holds the results at the end
        and self.stats the numbers of this call."""
        self.stats = Stats()
        reqs = [self._requests[self.add_request(p, params, i).seq_id] for i, p in enumerate(prompts)]
        while self.scheduler.has_work():
            for req, new, _ in self.step():
                if new:
                    yield req.index, new
        self.outputs = [Output(r.seq.prompt_ids, r.seq.output_ids, r.text, r.seq.finish_reason, r.ttft_s)
                        for r in reqs]
        for r in reqs:
            del self._requests[r.seq.seq_id]
        lens = [len(o.prompt_ids) + len(o.token_ids) for o in self.outputs]
        self.stats.kv = kv_memory(lens, self.kv_cache.block_size, self.kv_cache.token_bytes,
                                  self.model.config.max_position_embeddings)

    def generate(self, prompts, params: SamplingParams = DEFAULT_PARAMS) -> list:
        """Run every prompt to completion; [Output] in prompt order."""
        for _ in self.stream(prompts, params):
            pass
        return self.outputs
