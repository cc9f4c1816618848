"""KV blocks: who holds which, and the prefix cache. Pure Python: never touches the arrays.

A sequence owns a block table (block ids, kept on its Sequence); token t lives in slot
table[t // block_size] * block_size + t % block_size of every layer's pool. A block has a
reference count: the sequences whose tables hold it.

Prefix caching (automatic, as in vLLM and SGLang): a full block is known by the hash of its
token ids chained with the hash of the block before it, so equal hashes mean equal prefixes and
equal K/V. When a sequence's block fills, `cache_full_blocks` records its hash. A new sequence
takes every cached full block of its prefix (`match`, then `take`), sharing it read-only: the
sequence computes from the first token after them, so nobody writes a shared block. A block whose
last owner leaves keeps its hash and joins the free list at the most-recently-used end; `allocate`
takes the least recently used free block and forgets its hash. So cached blocks count as free,
and the oldest are evicted first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..errors import CuinferError


class OutOfBlocksError(CuinferError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(prev: bytes, tokens) -> bytes:
    """The hash of a full block: its token ids after the previous block's hash (b"" for the first)."""
    return hashlib.blake2b(prev + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise OutOfBlocksError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free = OrderedDict.fromkeys(range(num_blocks))  # least recently used first
        self._refs = [0] * num_blocks
        self._hash_of = {}  # block -> hash, for full blocks of known tokens
        self._block_of = {}  # hash -> block
        self.hit_tokens = 0  # prompt tokens taken from the cache, over the manager's life

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free)

    def usage(self) -> float:
        """The fraction of blocks held by live sequences (0.0 when idle)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list:
        """n fresh blocks (reference count 1), least recently freed first; OutOfBlocksError,
        allocating nothing, if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]  # evicted
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks) -> None:
        """Drop one reference to each block; a block with no owner left becomes free (and stays
        cached if it has a hash). Blocks are released last first, so a table's tail is evicted first."""
        for b in reversed(blocks):
            if self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def match(self, seq) -> list:
        """The cached blocks of seq's leading full blocks, up to (not including) its last token,
        which must be computed to give logits. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            b = self._block_of.get(self._hash(seq, i))
            if b is None:
                break
            blocks.append(b)
        return blocks

    def num_free_in(self, blocks) -> int:
        """How many of these (cached) blocks are free now: taking them uses up free blocks."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks) -> None:
        """One more owner for each of the blocks `match` returned (taken off the free list if free)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def cache_full_blocks(self, seq, num_known: int) -> None:
        """Record the hashes of seq's blocks that are full of computed tokens whose ids are known
        (the first num_known), so later sequences can take them; seq.num_registered counts the
        blocks already done. A block whose prefix is cached elsewhere already is left unhashed."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed, num_known) // self.block_size
        for i in range(seq.num_registered, full):
            b, h = seq.block_table[i], self._hash(seq, i)
            if b not in self._hash_of and h not in self._block_of:
                self._hash_of[b], self._block_of[h] = h, b
        seq.num_registered = max(seq.num_registered, full)

    def _hash(self, seq, i: int) -> bytes:
        """The chained hash of seq's full block i, made once (blocks in order) and kept on seq."""
        hashes = seq.block_hashes
        if i == len(hashes):
            bs = self.block_size
            hashes.append(chain_hash(hashes[-1] if hashes else b"", seq.token_slice(i * bs, (i + 1) * bs)))
        return hashes[i]

    def forget_cached(self) -> None:
        """Drop every block's hash: no later sequence takes a block cached so far (Engine.warm_up's)."""
        self._hash_of.clear()
        self._block_of.clear()

    def check(self) -> None:
        """Internal consistency (tests): the free list is exactly the blocks without owners, and
        the hash maps are inverse to each other."""
        free = {b for b in range(self.num_blocks) if self._refs[b] == 0}
        assert set(self._free) == free and len(self._free) == len(free)
        assert all(r >= 0 for r in self._refs)
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
        assert len(self._block_of) == len(self._hash_of)
