"""Draft-model speculation: a smaller model with the target's tokenizer proposes the drafts.

The draft model runs through the same code as the target (the catch-up chunk of a sequence as a
verify step, Verifier's CUDA graphs on the GPU, or Model.forward when it is a long prefill; then
one decode step per further draft token, DecodeGraph's CUDA graphs) with its own paged KV cache
and its own BlockManager (no prefix cache), as many blocks as the target's, in the target cache's
element format (an fp8 target cache gives an fp8 draft cache, else the draft model's dtype). Per
sequence it keeps a block table and how many of the sequence's tokens have their draft K/V in
place (`computed`). Proposing k tokens for a sequence of N tokens:

    catch-up: tokens computed..N-1 in one chunk -> logits at N-1 -> d1 ~ q1
    then for j = 2..k: token d(j-1) at position N+j-2 -> d(j) ~ q(j)

so the draft K/V of d1..d(k-1) sit at positions N..N+k-2. At the next proposal those of them that
the verification accepted (they equal the sequence's tokens there) stay computed, and the blocks
past `computed` are freed: the draft cache follows the target's rollback. A sequence resuming
after a backoff catches up in one chunk. State of sequences that finished or were preempted is
dropped. Sampled rows draw d(j) from q(j), the draft's distribution under the request's
temperature, top-k, top-p and min-p (sampling.token_probs), and hand q to the verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import CuinferError
from ..model.kv_cache import CacheShape, KVCache
from ..model.step_inputs import Batch
from ..ops import fp8
from .block_manager import BlockManager, blocks_for
from .runner import DecodeGraph
from .sampling import token_probs
from .spec import NO_DRAFT, Draft, inverse_cdf, spec_uniforms
from .verify import Verifier


@dataclass(eq=False)
class _DraftSeq:
    table: list = field(default_factory=list)  # draft KV blocks
    computed: int = 0  # the sequence's leading tokens whose draft K/V are in place
    written: list = field(default_factory=list)  # drafts whose K/V follow them (maybe rejected)


class DraftProposer:
    def __init__(self, draft, target, kv_cache, use_graphs: bool = True):
        """draft: a Model with the target's vocabulary; its cache gets as many blocks as kv_cache, fp8
        when kv_cache is (Engine's kv_cache_dtype), else in the draft's dtype."""
        if draft.config.vocab_size != target.config.vocab_size:
            raise CuinferError(f"speculative model: vocabulary of {draft.config.vocab_size} tokens, the target's "
                               f"has {target.config.vocab_size} (a draft needs the same tokenizer)")
        if draft.xp is not target.xp:
            raise CuinferError("speculative model: on another device than the target")
        cfg, bs = draft.config, kv_cache.block_size
        shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs)
        self.model = draft
        cache_dtype = fp8.FP8 if fp8.is_fp8(kv_cache) else draft.dtype
        try:
            self.cache = KVCache.allocate(shape, cache_dtype, draft.xp, kv_cache.num_blocks * bs)
        except CuinferError as e:
            raise CuinferError(f"speculative model: its KV cache: {e} (give the target a smaller one)") from None
        on_gpu = draft.xp is not np
        self.blocks = BlockManager(self.cache.num_blocks - on_gpu, bs, enable_prefix_caching=False)
        self.decoder = DecodeGraph(draft, self.cache, self.blocks.num_blocks, use_graphs) if on_gpu else None
        self.verifier = Verifier(draft, self.cache, use_graphs)  # short catch-up chunks, as verify steps
        self.runners = (self.decoder, self.verifier)  # whose new step shapes the engine watches
        self.state = {}  # Sequence -> _DraftSeq

    def propose(self, seqs, budgets, seeds) -> list:
        self._drop_gone()
        rows = [i for i, (s, k) in enumerate(zip(seqs, budgets)) if k and self._prepare(s, k)]
        drafts = [NO_DRAFT] * len(seqs)
        if not rows:
            return drafts
        bs = self.cache.block_size
        chunks = []
        for i in rows:
            s, st = seqs[i], self.state[seqs[i]]
            chunks.append((s.token_slice(st.computed, s.num_tokens), st.computed, st.table))
        if max(len(t) for t, _, _ in chunks) <= max(budgets) + 1:  # the steady state: 1 or 2 tokens
            ends = np.cumsum([len(t) for t, _, _ in chunks]) - 1
            logits = self.verifier.run(chunks)[self.model.xp.asarray(ends)]
        else:  # a first proposal or one after a backoff: a prefill
            logits = self.model.forward(Batch.from_chunks(chunks, bs).to(self.model.xp), self.cache)
        uniforms = {i: spec_uniforms(seeds[i], len(seqs[i].output_ids), 1, budgets[i]) for i in rows}
        out = {i: ([], []) for i in rows}  # tokens, q rows
        for j in range(max(budgets[i] for i in rows)):
            if j:
                live = [i for i in rows if budgets[i] > j]
                logits = self._decode([out[i][0][-1] for i in live], [seqs[i].num_tokens + j - 1 for i in live],
                                      [self.state[seqs[i]].table for i in live])
            else:
                live = rows
            self._pick(logits, [seqs[i].params for i in live], [uniforms[i][j] for i in live], [out[i] for i in live])
        for i in rows:
            st, (tokens, q) = self.state[seqs[i]], out[i]
            st.computed, st.written = seqs[i].num_tokens, tokens[:-1]
            drafts[i] = Draft(tokens, None if seqs[i].params.greedy else np.array(q))
        return drafts

    def _pick(self, logits, params, uniforms, outs) -> None:
        """Append each row's draft token (argmax, or a draw from its distribution) to outs."""
        xp = self.model.xp
        top = xp.argmax(logits, axis=-1)
        top = top.get() if xp is not np else top
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        q = token_probs(logits[xp.asarray(np.asarray(sampled, dtype=np.int64))], [params[r] for r in sampled]) \
            if sampled else None
        for r, (tokens, qs) in enumerate(outs):
            if params[r].greedy:
                tokens.append(int(top[r]))
            else:
                row = q[sampled.index(r)]
                tokens.append(inverse_cdf(row, uniforms[r]))
                qs.append(row)

    def _decode(self, tokens, positions, tables):
        """float32 logits [n, vocab] of one decode step of the draft model; the tables are cut to the
        blocks up to each position (they hold the slots of later drafts too, which DecodeGraph's
        context bucket, sized by the positions, may not cover)."""
        bs = self.cache.block_size
        tables = [t[:blocks_for(p + 1, bs)] for t, p in zip(tables, positions)]
        if self.decoder is not None:
            return self.decoder.run(tokens, positions, tables, greedy=False)
        batch = Batch.from_chunks([([t], p, b) for t, p, b in zip(tokens, positions, tables)],
                                  self.cache.block_size).to(self.model.xp)
        return self.model.forward(batch, self.cache)

    def _prepare(self, seq, k: int) -> bool:
        """Keep the accepted drafts of seq's last proposal (not the last token), free the blocks past them and reserve
        the slots of the catch-up chunk and the k - 1 drafts after it; False if they do not fit."""
        st = self.state.setdefault(seq, _DraftSeq())
        actual = seq.token_slice(st.computed, st.computed + len(st.written))
        st.computed += next((j for j, (a, b) in enumerate(zip(st.written, actual)) if a != b), len(actual))
        # the catch-up chunk holds the last token at least (its logits give d1): every token has draft
        # K/V when the engine dropped the last proposal and then decoded d1 itself
        st.computed = min(st.computed, seq.num_tokens - 1)
        st.written = []
        keep = blocks_for(st.computed, self.blocks.block_size)
        self.blocks.free(st.table[keep:])
        del st.table[keep:]
        need = max(0, blocks_for(seq.num_tokens + k - 1, self.blocks.block_size) - len(st.table))
        if need > self.blocks.num_free:
            return False
        st.table += self.blocks.allocate(need)
        return True

    def _drop_gone(self) -> None:
        """Free the draft blocks of sequences that finished or were preempted (no target blocks)."""
        for seq in [s for s in self.state if s.finish_reason is not None or not s.block_table]:
            self.blocks.free(self.state.pop(seq).table)
