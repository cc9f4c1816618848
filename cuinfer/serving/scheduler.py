"""Continuous batching: which sequences run in the next model step, and how many tokens each.

Pure Python, never imports CuPy. A step has a token budget (`max_batch_tokens`):
running sequences that decode take one token each first, sequences still in
prefill take chunks of what is left (chunked prefill: a long prompt never stalls
the decodes), then waiting sequences are admitted, oldest first, while the budget
and free KV blocks allow. An admitted sequence first takes the cached blocks of its
prefix (BlockManager.match) and computes from the token after them. When a running
sequence cannot get the block its next tokens need, the newest running sequence is
preempted: its blocks are freed (their full blocks stay cached) and it goes back to the
front of the queue to be recomputed from its prompt and the tokens it already generated.
Nothing is dropped.

The scheduler owns every state change of a sequence: admitted (waiting -> running),
preempted (running -> waiting), finished and aborted (-> gone, blocks freed), and what the
engine reports back: tokens computed (`computed`) and tokens appended (`append`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, blocks_for

PENDING = -1  # an output token still on the device (the engine's pipelined decode)
WINDOW_READ_MARGIN = 128  # keys an attention kernel may read (masked) before a window: its widest key tile


@dataclass(eq=False)
class Sequence:
    seq_id: object  # the request id
    prompt_ids: list
    params: object = None  # SamplingParams, read by the engine only
    output_ids: list = field(default_factory=list)
    block_table: list = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_hashes: list = field(default_factory=list)  # chained hashes of its full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_released: int = 0  # leading blocks behind every layer's window, no longer held (Scheduler.window)
    match_prefix: bool = True  # whether admission may take its prompt's blocks from the prefix cache

    @property
    def token_ids(self) -> list:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows (all but a pending one)."""
        out = self.output_ids
        return len(self.prompt_ids) + len(out) - (1 if out and out[-1] == PENDING else 0)

    def token_slice(self, start: int, stop: int) -> list:
        """token_ids[start:stop] without building the whole list."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:n] + self.output_ids[max(start - n, 0):stop - n]

    def token_at(self, i: int) -> int:
        """token_ids[i] without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache: the prompt (or its rest) in prefill, 1 when decoding."""
        return self.num_tokens - self.num_computed


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int = 512, max_num_seqs: int = 256, window: int = 0):
        """window: when every layer attends within a sliding window, the largest (0: some layer sees
        everything); a sequence's blocks wholly behind it are then released as it grows."""
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_batch_tokens and max_num_seqs must be >= 1, got "
                             f"{max_batch_tokens} and {max_num_seqs}")
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.window = window
        self.waiting: deque = deque()
        self.running: list = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.num_restored_tokens = 0  # tokens of preempted sequences taken back from the prefix cache

    def add(self, seq: Sequence) -> None:
        need = blocks_for(seq.num_tokens, self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"sequence {seq.seq_id}: {seq.num_tokens} tokens need {need} KV blocks, "
                             f"the cache has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list:
        """[(sequence, number of new tokens)] for the next step, decodes first."""
        budget = self.max_batch_tokens
        plan = {}
        preempted = set()  # the sequences preempted in this loop (Sequence hashes by identity)
        for seq in sorted(self.running, key=lambda s: s.remaining > 1):  # decodes, then prefills
            if seq in preempted or budget == 0:
                continue
            n = min(seq.remaining, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                budget += plan.pop(victim, 0)
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            else:
                plan[seq] = n
                budget -= n
        while not preempted:
            admission = self._admission(budget, self.blocks.num_free)
            if admission is None:
                break
            seq, cached, n = admission
            self._admit(seq, cached, n)
            plan[seq] = n
            budget -= n
        return list(plan.items())

    def reserve_decodes(self, seqs: list, leaving=()) -> bool:
        """Whether the next schedule() would return exactly `seqs`, in this order, one decode token
        each: every running sequence decodes, the budget holds them all, their next slots fit in the
        free blocks (nothing preempted) and no waiting sequence is admitted. If so, reserve those
        slots as schedule() would and return True; else change nothing and return False. The
        engine's pipelined decode asks this before the previous step's tokens are known: none of
        it depends on token values. leaving: running sequences that finish before that step (their
        pending token is their last); allowed only while nothing waits, since the blocks they
        free could admit a waiting sequence. They still hold those blocks while this reserves: the
        slots must fit in the blocks free now, so where only the leaving sequences' blocks would
        make room this says False though schedule() after their finish would decode `seqs` (the
        engine then decides that step on the real tokens)."""
        if leaving and self.waiting:
            return False
        gone = set(leaving)
        if ([s for s in self.running if s not in gone] != seqs or any(s.remaining != 1 for s in seqs)
                or len(seqs) > self.max_batch_tokens):
            return False
        need = sum(max(0, blocks_for(s.num_computed + 1, self.block_size) - len(s.block_table)) for s in seqs)
        free = self.blocks.num_free - need
        if free < 0 or self._admission(self.max_batch_tokens - len(seqs), free) is not None:
            return False
        for s in seqs:
            self._reserve(s, s.num_computed + 1)
        return True

    def reserve_draft(self, seq: Sequence, k: int) -> bool:
        """Reserve the slots of k draft tokens after seq's scheduled decode token, from free blocks
        only (never preempting); False, changing nothing, if they do not fit."""
        return self._reserve(seq, seq.num_computed + 1 + k)

    def rollback(self, seq: Sequence) -> None:
        """Free seq's blocks past its computed tokens: after a verify step, those that held only
        rejected drafts. Their slots were never counted as computed, so no block holding a
        rejected token was offered to the prefix cache."""
        keep = blocks_for(seq.num_computed, self.block_size)
        if seq.finish_reason is None and len(seq.block_table) > keep:
            self.blocks.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def computed(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens have their K/V in the cache (or will, once the step in flight runs)."""
        seq.num_computed += n
        self.blocks.cache_full_blocks(seq, seq.num_known)
        if self.window:
            self._release_behind_window(seq)

    def append(self, seq: Sequence, token: int) -> None:
        """A new output token (PENDING: one the device has not returned yet); a real token replaces
        a pending one."""
        if token != PENDING and seq.output_ids and seq.output_ids[-1] == PENDING:
            seq.output_ids[-1] = token
        else:
            seq.output_ids.append(token)
        self.blocks.cache_full_blocks(seq, seq.num_known)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a running sequence and free its blocks (its full blocks stay cached)."""
        seq.finish_reason = reason
        self.running.remove(seq)
        self._release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence at once, freeing its blocks."""
        if seq in self.running:
            self.finish(seq, "abort")
        else:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"

    def _admission(self, budget: int, free: int):
        """(sequence, its cached blocks, tokens to compute) for the oldest waiting sequence, if the
        budget, max_num_seqs and `free` blocks admit it now; else None. Changes nothing."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return None
        seq = self.waiting[0]
        cached = self.blocks.match(seq) if seq.match_prefix else []
        start = len(cached) * self.block_size
        n = min(seq.num_tokens - start, budget)
        need = blocks_for(start + n, self.block_size) - len(cached) + self.blocks.num_free_in(cached)
        return (seq, cached, n) if need <= free else None

    def _admit(self, seq: Sequence, cached: list, n: int) -> None:
        self.waiting.popleft()
        self.blocks.take(cached)
        seq.block_table = list(cached)
        seq.num_registered = len(cached)
        seq.num_computed = len(cached) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
            self.blocks.hit_tokens += seq.num_computed
        else:
            self.num_restored_tokens += seq.num_computed
        self._reserve(seq, seq.num_computed + n)
        self.running.append(seq)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need > self.blocks.num_free:
            return False
        if need > 0:
            seq.block_table += self.blocks.allocate(need)
        return True

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table[seq.num_released:])
        seq.block_table = []
        seq.num_registered = seq.num_released = 0

    def _release_behind_window(self, seq: Sequence) -> None:
        """Stop holding seq's leading blocks that no query of it will read again: its next query
        (position num_computed) sees keys past num_computed - window, and the attention kernels
        start at most WINDOW_READ_MARGIN keys earlier (a key tile's alignment; those keys are
        masked, so whatever a released block holds by then never counts). The released blocks stay
        in the table, keep their prefix-cache hashes, and count as free."""
        first_read = seq.num_computed - self.window + 1 - WINDOW_READ_MARGIN
        n = min(max(0, first_read // self.block_size), len(seq.block_table))
        if n > seq.num_released:
            self.blocks.free(seq.block_table[seq.num_released:n])
            seq.num_released = n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
