"""BlockManager: reference counts, the prefix cache (chained hashes, LRU eviction), and a stateful
test of scheduler + block manager under random arrivals, aborts, preemptions and finishes."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cuinfer.serving.block_manager import BlockManager, OutOfBlocksError, chain_hash
from cuinfer.serving.scheduler import Scheduler, Sequence


def computed_seq(bm, tokens, seq_id=0):
    """A sequence holding fresh blocks for all its tokens, every one computed and offered to the cache."""
    seq = Sequence(seq_id, list(tokens))
    seq.block_table = bm.allocate(-(-len(tokens) // bm.block_size))
    seq.num_computed = len(tokens)
    bm.cache_full_blocks(seq, seq.num_known)
    return seq


def test_allocate_free_reuse():
    bm = BlockManager(4, 16)
    x = bm.allocate(3)
    assert sorted(x) == [0, 1, 2] and bm.num_free == 1 and bm.usage() == 0.75
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 of 4 free"):
        bm.allocate(2)
    assert bm.num_free == 1  # a failed allocation takes nothing
    bm.free(x[:2])
    assert bm.num_free == 3
    with pytest.raises(ValueError, match="freed twice"):
        bm.free([x[0]])
    bm.check()


def test_full_blocks_are_found_by_their_chained_hash():
    bm = BlockManager(8, 4)
    a = computed_seq(bm, range(10))  # blocks 0-3, 4-7 full; 8-9 partial
    assert len(bm._block_of) == 2
    b = Sequence(1, list(range(8)) + [99, 98, 97])
    assert bm.match(b) == a.block_table[:2]
    c = Sequence(2, [0, 1, 2, 3, 9, 9, 9, 9, 5])  # same first block, different second
    assert bm.match(c) == a.block_table[:1]
    d = Sequence(3, [4, 5, 6, 7, 0, 1, 2, 3, 1])  # the second block's tokens, but not after the first's
    assert bm.match(d) == []
    e = Sequence(4, list(range(8)))  # its last token must be computed: only the first block matches
    assert bm.match(e) == a.block_table[:1]
    assert chain_hash(b"", [1, 2]) != chain_hash(b"", [2, 1])


def test_cached_blocks_count_as_free_and_are_evicted_least_recent_first():
    bm = BlockManager(4, 4)
    a = computed_seq(bm, range(8), 0)  # 2 full blocks
    b = computed_seq(bm, range(100, 108), 1)
    bm.free(a.block_table)
    bm.free(b.block_table)  # b's blocks are the most recently used
    assert bm.num_free == 4 and bm.usage() == 0.0
    assert bm.match(Sequence(2, list(range(8)) + [1])) == a.block_table
    bm.allocate(2)  # evicts a's blocks, not b's
    assert bm.match(Sequence(2, list(range(8)) + [1])) == []
    assert bm.match(Sequence(3, list(range(100, 108)) + [1])) == b.block_table
    bm.check()


def test_taking_a_cached_block_shares_it():
    bm = BlockManager(4, 4)
    a = computed_seq(bm, range(8), 0)
    cached = bm.match(Sequence(1, list(range(8)) + [5]))
    assert bm.num_free_in(cached) == 0
    bm.take(cached)
    bm.free(a.block_table)
    assert bm.num_free == 2  # the shared blocks still have an owner
    bm.free(cached)
    assert bm.num_free == 4
    bm.check()


PREFIXES = [[7] * 13, list(range(20)), list(range(5, 40))]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (many sharing a prefix), steps with random finishes, aborts, speculative
    verify steps (drafts written to reserved slots, a random number accepted, the rest rolled
    back); after every rule: no block leaked or held twice without sharing, reference counts equal
    the tables holding each block, a block a sequence will still write is never shared, usage 0.0
    when idle, and every block in the prefix cache holds exactly the tokens of its hash (the
    machine records which token each step wrote to each slot): never a rejected draft."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(24, 4)
        self.sched = Scheduler(self.bm, max_batch_tokens=32, max_num_seqs=6)
        self.seqs = []
        self.next_id = 0
        self.written = {}  # block -> {offset: token id last written there}

    def write(self, seq, tokens):
        """A step wrote K/V of `tokens` at seq's positions from num_computed on."""
        for pos, t in enumerate(tokens, seq.num_computed):
            self.written.setdefault(seq.block_table[pos // 4], {})[pos % 4] = t

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 50), max_size=12),
          keep=st.integers(1, 40))
    def arrive(self, prefix, tail, keep):
        tokens = (prefix + tail)[:keep]
        if -(-(len(tokens) + 8) // 4) > self.bm.num_blocks:
            return
        seq = Sequence(self.next_id, tokens)
        self.next_id += 1
        self.sched.add(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.sched.has_work())
    @rule(token=st.integers(0, 50), finish=st.sets(st.integers(0, 5)))
    def step(self, token, finish):
        plan = self.sched.schedule()
        assert plan, "no progress"
        assert sum(n for _, n in plan) <= self.sched.max_batch_tokens
        for seq, n in plan:
            assert len(seq.block_table) * 4 >= seq.num_computed + n
            self.write(seq, seq.token_slice(seq.num_computed, seq.num_computed + n))
            self.sched.computed(seq, n)
        for i, (seq, _) in enumerate(plan):
            if seq.num_computed == seq.num_tokens:
                self.sched.append(seq, token)
                if i in finish or len(seq.output_ids) >= 8:
                    self.sched.finish(seq, "length")

    @precondition(lambda self: self.sched.has_work())
    @rule(drafts=st.lists(st.integers(0, 50), min_size=1, max_size=6), accepted=st.integers(0, 6),
          finish=st.sets(st.integers(0, 5)))
    def verify(self, drafts, accepted, finish):
        """A step whose decoding sequences carry drafts where their slots fit (prefill chunks run as
        usual): each keeps `accepted` of them plus a token that differs from the next draft."""
        for i, (seq, n) in enumerate(self.sched.schedule()):
            decoding = n == 1 and seq.remaining == 1 and seq.num_computed >= len(seq.prompt_ids)
            d = drafts if decoding and self.sched.reserve_draft(seq, len(drafts)) else []
            a = min(accepted, len(d))
            bonus = (d[a] + 1) % 51 if a < len(d) else 7
            self.write(seq, seq.token_slice(seq.num_computed, seq.num_computed + n) + d)
            self.sched.computed(seq, n + a)
            if seq.num_computed < seq.num_tokens:
                continue
            for t in d[:a] + [bonus]:
                self.sched.append(seq, t)
                if i in finish or len(seq.output_ids) >= 8:
                    self.sched.finish(seq, "length")
                    break
            self.sched.rollback(seq)
            if seq.finish_reason is None:
                assert len(seq.block_table) == -(-seq.num_computed // 4)

    @precondition(lambda self: any(s.finish_reason is None for s in self.seqs))
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        live = [s for s in self.seqs if s.finish_reason is None]
        self.sched.abort(live[pick % len(live)])

    @invariant()
    def blocks_consistent(self):
        self.bm.check()
        refs = {}
        for s in self.sched.running:
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
            for b in s.block_table[s.num_computed // 4:]:  # blocks it will still write
                assert self.bm._refs[b] == 1, "a block being written is shared"
        assert all(self.bm._refs[b] == n for b, n in refs.items())
        assert sum(self.bm._refs) == sum(refs.values())
        assert all(not s.block_table for s in self.sched.waiting)
        assert all(not s.block_table for s in self.seqs if s.finish_reason is not None)
        if not self.sched.running:
            assert self.bm.usage() == 0.0

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        tokens_of = {h: s.token_slice(4 * i, 4 * i + 4) for s in self.seqs for i, h in enumerate(s.block_hashes)}
        for b, h in self.bm._hash_of.items():
            assert [self.written[b].get(j) for j in range(4)] == tokens_of[h], f"block {b} holds other tokens"
        for s in self.sched.running:
            for pos in range(s.num_computed):
                assert self.written[s.block_table[pos // 4]][pos % 4] == s.token_at(pos)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
