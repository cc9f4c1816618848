"""Scheduler: budgets, chunked prefill, admission by free blocks, preemption of the newest;
reserve_decodes agrees with schedule()."""
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuinfer.serving.block_manager import BlockManager, blocks_for
from cuinfer.serving.scheduler import Scheduler, Sequence


def simulate_step(sched, plan, new_token=7):
    """What the engine does after the model ran: mark computed, append a token where a chunk finished."""
    for seq, n in plan:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(new_token)


def test_never_imports_cupy():
    src = open(sys.modules[Scheduler.__module__].__file__).read()
    assert "cupy" not in src.replace("never imports CuPy", "")


def test_decodes_first_then_prefill_chunks_within_budget():
    sched = Scheduler(BlockManager(100, 16, enable_prefix_caching=False), max_batch_tokens=64)
    a, b = Sequence(0, [1] * 10), Sequence(1, [1] * 1500)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan] == [(0, 10), (1, 54)]
    simulate_step(sched, plan)
    for _ in range(5):
        plan = sched.schedule()
        assert plan[0] == (a, 1)  # the decode is never stalled by the long prompt
        assert plan[1][0] is b and plan[1][1] == 63
        assert sum(n for _, n in plan) <= 64
        simulate_step(sched, plan)


def test_admission_waits_for_blocks():
    sched = Scheduler(BlockManager(3, 16, enable_prefix_caching=False), max_batch_tokens=512)
    a, b = Sequence(0, [1] * 40), Sequence(1, [1] * 20)  # 3 blocks, then 2 blocks
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [s for s, _ in plan] == [a] and list(sched.waiting) == [b]
    sched.finish(a, "length")
    assert [s for s, _ in sched.schedule()] == [b]


def test_preempts_newest_and_requeues_it_first():
    sched = Scheduler(BlockManager(4, 4, enable_prefix_caching=False), max_batch_tokens=512)
    seqs = [Sequence(i, [1] * 4) for i in range(4)]  # one full block each
    for s in seqs:
        sched.add(s)
    simulate_step(sched, sched.schedule())  # each now needs a second block to decode
    plan = sched.schedule()
    assert [s.seq_id for s, _ in plan] == [0, 1]  # 3 and 2 were preempted to feed 0 and 1
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    assert seqs[3].num_computed == 0 and seqs[3].block_table == [] and seqs[3].output_ids == [7]
    assert sched.num_preemptions == 2


def test_too_long_for_the_whole_cache_is_rejected():
    sched = Scheduler(BlockManager(2, 16, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="need 3 KV blocks, the cache has 2"):
        sched.add(Sequence(0, [1] * 33))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=12), st.integers(8, 40),
       st.integers(1, 20), st.sampled_from([4, 16]), st.integers(1, 200))
def test_every_sequence_finishes_and_blocks_are_returned(prompt_lens, num_blocks, max_new, bs, budget):
    sched = Scheduler(BlockManager(num_blocks, bs, enable_prefix_caching=False), max_batch_tokens=budget)
    seqs = []
    for i, n in enumerate(prompt_lens):
        if blocks_for(n + max_new, bs) <= num_blocks:
            seqs.append(Sequence(i, [1] * n))
            sched.add(seqs[-1])
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan, "no progress"
        assert sum(n for _, n in plan) <= budget
        for s, _ in plan:
            assert len(s.block_table) * bs >= s.num_computed + dict(plan)[s]
        used = [b for s in sched.running for b in s.block_table]
        assert len(used) == len(set(used)) == num_blocks - sched.blocks.num_free
        simulate_step(sched, plan)
        for s, _ in plan:
            if len(s.output_ids) == max_new:
                sched.finish(s, "length")
        steps += 1
        assert steps < 10000
    assert all(len(s.output_ids) == max_new for s in seqs)
    assert sched.blocks.num_free == num_blocks


def test_reserve_decodes_reserves_the_next_slot_only_in_the_steady_state():
    sched = Scheduler(BlockManager(6, 4, enable_prefix_caching=False), max_batch_tokens=8)
    a, b = Sequence(0, [1] * 3), Sequence(1, [1] * 4)
    sched.add(a)
    sched.add(b)
    simulate_step(sched, sched.schedule())  # a: 4 tokens in 1 block, b: 5 tokens in 1 block (+1 for the next)
    assert not sched.reserve_decodes([b, a])  # not the running order
    assert not sched.reserve_decodes([a])  # not every running sequence
    free = sched.blocks.num_free
    assert sched.reserve_decodes([a, b])
    assert [len(a.block_table), len(b.block_table)] == [1, 2] and sched.blocks.num_free == free - 1
    assert sched.schedule() == [(a, 1), (b, 1)] and sched.blocks.num_free == free - 1  # nothing more to take
    # a waiting sequence that fits would be admitted: not the steady state, nothing reserved
    simulate_step(sched, [(a, 1), (b, 1)])
    c = Sequence(2, [1] * 4)
    sched.add(c)
    free = sched.blocks.num_free
    assert not sched.reserve_decodes([a, b]) and sched.blocks.num_free == free
    # one that cannot fit (or no budget left for it) is not admitted: steady again
    sched.max_batch_tokens = 2
    assert sched.reserve_decodes([a, b])


def test_reserve_decodes_refuses_what_would_preempt_or_exceed_the_budget():
    sched = Scheduler(BlockManager(2, 4, enable_prefix_caching=False), max_batch_tokens=8)
    a, b = Sequence(0, [1] * 4), Sequence(1, [1] * 4)
    sched.add(a)
    sched.add(b)
    simulate_step(sched, sched.schedule())  # 5 tokens each: the next slot needs a new block each, none free
    assert not sched.reserve_decodes([a, b]) and sched.blocks.num_free == 0
    sched.max_batch_tokens = 1
    assert not sched.reserve_decodes([a, b])
    x = Sequence(2, [1] * 2)  # still in prefill: remaining 2
    s2 = Scheduler(BlockManager(4, 4, enable_prefix_caching=False), max_batch_tokens=1)
    s2.add(x)
    s2.schedule()
    x.num_computed += 1
    assert x.remaining == 1 and s2.reserve_decodes([x])  # its last prompt token: one token, as schedule() gives


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(4, 30), st.sampled_from([4, 16]),
       st.integers(1, 64), st.integers(1, 6), st.integers(0, 30), st.integers(0, 3), st.integers(0, 2))
def test_reserve_decodes_agrees_with_schedule(prompt_lens, num_blocks, bs, budget, max_seqs, steps, late, leave):
    """Wherever reserve_decodes says yes, schedule() on the same state (the `leave` first running
    sequences finished first) returns exactly the other running sequences with one token each,
    preempting nothing and admitting nothing, and reserves the same blocks; wherever it says no,
    schedule() does something else, or sequences leave while others wait, or the others' next
    slots need more blocks than are free before the leaving ones release theirs, and
    reserve_decodes changed nothing."""
    import copy

    sched = Scheduler(BlockManager(num_blocks, bs, enable_prefix_caching=False), max_batch_tokens=budget,
                      max_num_seqs=max_seqs)
    seqs = [Sequence(i, [1] * n) for i, n in enumerate(prompt_lens) if blocks_for(n + 40, bs) <= num_blocks]
    for s in seqs[:len(seqs) - late]:
        sched.add(s)
    for k in range(steps):
        if k == steps // 2:
            for s in seqs[len(seqs) - late:]:
                sched.add(s)
        if not sched.has_work():
            break
        simulate_step(sched, sched.schedule())
    said = copy.deepcopy(sched)
    yes = said.reserve_decodes(said.running[leave:], said.running[:leave])
    ref = copy.deepcopy(sched)
    released = sum(len(s.block_table) for s in ref.running[:leave])
    for s in ref.running[:leave]:
        ref.finish(s, "length")
    plan = ref.schedule()
    rest = sched.running[leave:]
    steady = (all(s.remaining == 1 for s in rest)  # decodes, not 1-token prefill chunks
              and [(s.seq_id, n) for s, n in plan] == [(s.seq_id, 1) for s in rest]
              and ref.num_preemptions == sched.num_preemptions and len(ref.waiting) == len(sched.waiting))
    new_blocks = sum(max(0, blocks_for(s.num_computed + 1, bs) - len(s.block_table)) for s in rest)
    fits_now = new_blocks <= sched.blocks.num_free  # the leaving sequences still hold their blocks
    assert yes == (steady and fits_now and not (sched.running[:leave] and sched.waiting))
    if yes:
        assert [s.block_table for s in said.running[leave:]] == [s.block_table for s, _ in plan]
        assert said.blocks.num_free + released == ref.blocks.num_free
    else:
        assert [s.block_table for s in said.running] == [s.block_table for s in sched.running]
        assert said.blocks.num_free == sched.blocks.num_free


def test_reserve_decodes_leaving_blocks_are_not_free_yet():
    """Hypothesis's example: the only room for the others' next slots is a leaving sequence's
    blocks, which it still holds while the next step is reserved: no reservation, nothing changed."""
    sched = Scheduler(BlockManager(11, 4, enable_prefix_caching=False), max_batch_tokens=4, max_num_seqs=4)
    seqs = [Sequence(i, [1] * n) for i, n in enumerate([1, 1, 2, 1])]
    for s in seqs:
        sched.add(s)
    for _ in range(9):
        simulate_step(sched, sched.schedule())
    assert sched.blocks.num_free == 0 and not sched.waiting
    tables = [list(s.block_table) for s in sched.running]
    assert not sched.reserve_decodes(sched.running[1:], sched.running[:1])
    assert [s.block_table for s in sched.running] == tables
