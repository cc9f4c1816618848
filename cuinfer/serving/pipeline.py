"""Pipelined decode (Engine.async_decode), kept apart from engine.py: PipelinedDecode is a base class of
Engine. A decode step whose tokens are made in the graph (greedy, or sampled without penalties and
logprobs) is launched, and the step after it launched from its device tokens before the host reads
them; docs/serving.md gives the invariants. Its methods use the engine's scheduler, decoder,
requests and output methods."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .sampling import graph_sampleable
from .scheduler import PENDING


@dataclass(eq=False)
class _Launched:
    """A decode step (greedy or graph-sampled) launched on the device whose tokens the host has not
    read yet."""
    seqs: list  # its rows, in order; a row whose sequence finished meanwhile is discarded
    tokens: object  # device int32 [rows]: the input tokens of the step pipelined after it
    pending: object  # PendingTokens: wait() -> the tokens as ints


class PipelinedDecode:
    def _pipelined_step(self, t0) -> list:
        """Engine.step with a decode step in flight: the next one launched from its device tokens where
        _pipelined_rows allows, then the step in flight read; [RequestOutput] of its rows."""
        current, following = self._inflight, None
        keep = self._pipelined_rows(current.seqs)
        if keep is not None:  # the next step's KV slots are now reserved
            tokens = current.tokens
            if len(keep) < len(current.seqs):  # its rows' tokens, gathered on the device
                tokens = tokens[self.model.xp.asarray(np.asarray(keep, dtype=np.int32))]
            following = self._launch([current.seqs[i] for i in keep], tokens)
            self.stats.pipelined_steps += 1
            self._note_kv_blocks()
        self._inflight = None
        events = self._resolve(current)
        self._inflight = following
        if self._inflight is not None:
            self._begin(self._inflight)
            if all(s.finish_reason is not None for s in self._inflight.seqs):
                # all its rows are discarded: resolve it now, so that a step is in flight only while
                # the scheduler has work (callers loop on has_unfinished_requests())
                self._resolve(self._inflight)
                self._inflight = None
        elapsed = time.perf_counter() - t0
        self.stats.decode_s += elapsed
        self.stats.decode_tokens += len(events)
        if self.spec is not None:
            self.spec.note_plain_step(len(current.seqs), elapsed)
        return events


    def _launches(self, plan) -> bool:
        """Whether the step goes through _launch: on the decoder, every sequence decoding (one token
        past its prompt that yields its next token; a prompt's last token is prefill) and its token
        made in the graph (greedy, or sampled without penalties and logprobs)."""
        return (self.async_decode and self.decoder is not None
                and all(n == 1 and s.remaining == 1 and s.num_computed >= len(s.prompt_ids) for s, n in plan)
                and all(graph_sampleable(s.params) for s, _ in plan))

    def _pipelined_rows(self, seqs):
        """The rows (indices into `seqs`) of the step after `seqs`' in-flight step, if it may be
        launched before that step's tokens are read (docs/serving.md), its KV slots then reserved;
        else None. While nothing waits for admission, a sequence whose pending token is its last
        (max_new_tokens, the context) or that was aborted meanwhile gets no row. Host logic only."""
        if self._verifies([(s, 1) for s in seqs]):
            return None  # the next step verifies drafts: it is built from the real tokens
        waiting = bool(self.scheduler.waiting)
        keep, leaving = [], []
        for i, s in enumerate(seqs):
            p = s.params
            if s.finish_reason is not None:
                continue
            if len(s.output_ids) >= p.max_new_tokens or s.num_tokens >= self.max_len:
                leaving.append(s)
            elif waiting and (p.stop_token_ids or p.stop or (self.eos_token_ids and not p.ignore_eos)):
                return None  # its finish could admit a waiting request: decide on the real tokens
            else:
                keep.append(i)
        if not keep or (waiting and len(keep) < len(seqs)):
            return None  # a finish frees the room that admits a waiting request: decide after it
        return keep if self.scheduler.reserve_decodes([seqs[i] for i in keep], leaving) else None

    def _launch(self, seqs, device_tokens) -> _Launched:
        """Launch a decode step of `seqs` (greedy or graph-sampled) at their num_computed positions;
        the input tokens are device_tokens (the previous step's output, rows in the same order) or,
        when None, the sequences' own tokens (then none may be PENDING). Nothing is read back or
        waited for. A pending token counts in its sequence's output length (the uniform's step)."""
        if device_tokens is None:
            token_ids = [s.token_at(s.num_computed) for s in seqs]
            assert PENDING not in token_ids, "a pending token was read on the host"
        else:
            token_ids = [0] * len(seqs)  # replaced on the device
        out = self._decode_tokens(seqs, token_ids, device_tokens)
        return _Launched(list(seqs), out, self.decoder.read_async(out))

    def _begin(self, launched: _Launched) -> None:
        """Bookkeep a launched step as done with its tokens unknown (rows of finished sequences are
        left out: their tokens will be discarded)."""
        for s in launched.seqs:
            if s.finish_reason is None:
                self.scheduler.computed(s, 1)
                self.scheduler.append(s, PENDING)

    def _resolve(self, launched: _Launched) -> list:
        """Wait for a launched step's tokens (its copy's event only) and put them in place of the
        PENDING placeholders; rows of sequences finished meanwhile are discarded."""
        tokens = launched.pending.wait()
        now = time.perf_counter()
        # A finish frees the blocks at once, though a step pipelined after this one may still write
        # the sequence's next slot: GPU work that could reuse them is enqueued later on the same
        # stream (a graph capture synchronizes the device first), so it runs after.
        return [self._append(self._requests[s.seq_id], int(t), now)
                for s, t in zip(launched.seqs, tokens) if s.finish_reason is None]
