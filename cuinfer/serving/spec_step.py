"""The Engine's verify steps (docs/speculative.md), kept apart from engine.py: SpeculativeSteps is a
base class of Engine, its methods use the engine's scheduler, speculator, verifier, requests and
output methods."""
from __future__ import annotations

import itertools
import time

import numpy as np

from .sampling import graph_sampleable
from .spec import NO_DRAFT, accept_greedy, verify


class SpeculativeSteps:
    def _verifies(self, plan) -> bool:
        """Whether the step `plan` is a verify step (cuinfer/serving/spec.py): speculation is on and
        Speculator.wants it."""
        return self.spec is not None and self.spec.wants(plan)

    def _spec_step(self, plan, t0) -> list:
        """A verify step (cuinfer/serving/spec.py): every sequence decodes its last token and the due
        ones their drafts after it, in one forward; each keeps what the verification accepts, and
        the slots of rejected drafts are rolled back. Without any draft: a plain synchronous step.
        A greedy step is launched, the bookkeeping that needs none of its tokens done while it
        runs, and then its tokens are waited for."""
        seqs = [s for s, _ in plan]
        reqs = [self._requests[s.seq_id] for s in seqs]
        shapes = self._graph_shapes()
        budgets = self.spec.budgets(seqs, self.max_len)
        drafts = self.spec.propose(seqs, budgets, [r.seed for r in reqs])
        drafts = [d if d.tokens and self.scheduler.reserve_draft(s, len(d.tokens)) else NO_DRAFT
                  for s, d in zip(seqs, drafts)]
        if not any(d.tokens for d in drafts):
            for s, k in zip(seqs, budgets):
                if k:
                    self.spec.record(s, 0, 0)
            return self._sync_step(plan, t0)
        chunks = [([s.token_at(s.num_computed)] + d.tokens, s.num_computed, s.block_table)
                  for s, d in zip(seqs, drafts)]
        starts = list(itertools.accumulate((len(c[0]) for c in chunks), initial=0))
        pending = None
        if all(s.params.greedy and graph_sampleable(s.params) for s in seqs):  # only each row's argmax comes back
            pending = self.verifier.launch(chunks)
        else:
            kept, lps = self._verify(seqs, drafts, self.verifier.run(chunks), starts)
        timed = self._graph_shapes() == shapes  # a step that met a new shape captured a graph
        self._note_kv_blocks()
        self.stats.draft_tokens += sum(len(d.tokens) for d in drafts)
        self.stats.verify_rows += sum(1 for d in drafts if d.tokens)
        if pending is not None:
            targets = pending.wait()
            kept = [accept_greedy(targets[a:b], d.tokens) for a, b, d in zip(starts, starts[1:], drafts)]
            lps = [None] * len(seqs)
        now = time.perf_counter()
        events = []
        for s, r, d, tokens, lp in zip(seqs, reqs, drafts, kept, lps):
            self.scheduler.computed(s, len(tokens))  # the last token and the accepted drafts
            events.append(self._append_all(r, tokens, lp, now))
            self.scheduler.rollback(s)
            if d.tokens:
                self.stats.accepted_tokens += len(tokens) - 1
        elapsed = time.perf_counter() - t0
        cost = self.spec.note_verify_step(len(seqs), elapsed if timed else None)
        for s, d, k, tokens in zip(seqs, drafts, budgets, kept):
            if k:
                self.spec.record(s, len(d.tokens), len(tokens) - 1, cost)
        self.stats.decode_s += elapsed
        self.stats.decode_tokens += sum(len(o.new_token_ids) for o in events)
        return events

    def _graph_shapes(self) -> int:
        """Step shapes the decode and verify runners (the draft model's too) have met: a new one
        captured a graph, so the step that met it says nothing of a step's cost."""
        runners = (self.decoder, self.verifier, *getattr(self.spec.proposer, "runners", ()))
        return sum(len(getattr(r, "steps", ())) for r in runners)

    def _verify(self, seqs, drafts, logits, starts):
        """(tokens, logprobs entries or None) per sequence from a verify step's logits (starts: where
        each sequence's rows start, and their end): drafted sequences through spec.verify, the
        others sampled as a plain step samples them (penalties, logprobs and seeded draws included)."""
        xp, starts = self.model.xp, np.asarray(starts)
        drafted = [i for i, d in enumerate(drafts) if d.tokens]
        plain = [i for i, d in enumerate(drafts) if not d.tokens]
        kept, lps = [None] * len(seqs), [None] * len(seqs)
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in drafted])
        found = verify(logits[xp.asarray(rows)], [seqs[i] for i in drafted], [drafts[i] for i in drafted],
                       [self._requests[seqs[i].seq_id].seed for i in drafted])
        for i, tokens in zip(drafted, found):
            kept[i] = tokens
        if plain:
            tokens, entries = self._sample([seqs[i] for i in plain], logits[xp.asarray(starts[plain])])
            for i, t, entry in zip(plain, tokens, entries):
                kept[i], lps[i] = [int(t)], [entry]
        return kept, lps
