"""Continuous batching: which sequences run in the next model step, and how many tokens each.

Pure Python, never imports CuPy. A step has a token budget (`max_batch_tokens`):
running sequences that decode take one token each first, sequences still in
prefill take chunks of what is left (chunked prefill: a long prompt never stalls
the decodes), then waiting sequences are admitted, oldest first, while the budget
and free KV blocks allow. When a running sequence cannot get the block its next
tokens need, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed from its prompt and the
tokens it already generated. Nothing is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..model.kv_cache import BlockAllocator, blocks_for


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list
    params: object = None  # SamplingParams, read by the engine only
    output_ids: list = field(default_factory=list)
    block_table: list = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        """token_ids[i] without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache: the prompt (or its rest) in prefill, 1 when decoding."""
        return self.num_tokens - self.num_computed


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_tokens: int = 512,
                 max_num_seqs: int = 256):
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_batch_tokens and max_num_seqs must be >= 1, got "
                             f"{max_batch_tokens} and {max_num_seqs}")
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque = deque()
        self.running: list = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        need = blocks_for(seq.num_tokens, self.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(f"sequence {seq.seq_id}: {seq.num_tokens} tokens need {need} KV blocks, "
                             f"the cache has {self.allocator.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list:
        """[(sequence, number of new tokens)] for the next step, decodes first."""
        budget = self.max_batch_tokens
        plan = {}
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.remaining > 1):  # decodes, then prefills
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.remaining, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                budget += plan.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                plan[seq] = n
                budget -= n
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.remaining, budget)
            if not self._reserve(seq, seq.num_computed + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan[seq] = n
            budget -= n
        return list(plan.items())

    def reserve_decodes(self, seqs: list) -> bool:
        """When the next schedule() would return exactly `seqs`, in this order, one decode token
        each (every running sequence decodes, the budget holds them all, their next slots fit in
        the free blocks, so nothing is preempted, and no waiting sequence would be admitted):
        reserve those slots as schedule() would and return True. Else change nothing and return
        False. The engine's pipelined decode asks this before the previous step's tokens are
        known: none of that depends on token values."""
        if self.running != seqs or any(s.remaining != 1 for s in seqs) or len(seqs) > self.max_batch_tokens:
            return False
        need = sum(max(0, blocks_for(s.num_computed + 1, self.block_size) - len(s.block_table)) for s in seqs)
        free = self.allocator.num_free - need
        if free < 0:
            return False  # schedule() would preempt
        budget = self.max_batch_tokens - len(seqs)
        if self.waiting and budget > 0 and len(seqs) < self.max_num_seqs:
            first = self.waiting[0]
            n = min(first.remaining, budget)
            if blocks_for(first.num_computed + n, self.block_size) - len(first.block_table) <= free:
                return False  # schedule() would admit it
        for s in seqs:
            self._reserve(s, s.num_computed + 1)
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a running sequence and free its blocks."""
        seq.finish_reason = reason
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            seq.block_table += self.allocator.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
