"""A model step's inputs, host-side: Batch (any mix of prompt chunks and decodes, Model.forward's),
DecodeInputs (one token per sequence, Model.decode's) and the one int32 buffer the decode graphs keep
them in (input_views, pack_inputs)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import numpy as np


def slot_mapping(tables, rows, positions, block_size: int):
    """int32 cache slot of each token: its row's block tables[rows, positions // block_size], offset
    positions % block_size (for Batch and DecodeGraph's inputs; verify.pack_chunks computes the same
    per chunk in Python)."""
    block = tables[rows, positions // block_size].astype(np.int64)
    return (block * block_size + positions % block_size).astype(np.int32)


@dataclass
class DecodeInputs:
    """Model.decode's inputs, int32, one row per sequence (DecodeGraph keeps them in static buffers)."""
    token_ids: object  # [num_seqs]
    positions: object  # [num_seqs]
    slot_mapping: object  # [num_seqs]
    block_tables: object  # [num_seqs, max_blocks]
    context_lens: object  # [num_seqs] = positions + 1


@dataclass
class Batch:
    """One model step. All int32; tokens = sum of q_len over the sequences."""
    token_ids: object  # [tokens]
    positions: object  # [tokens]
    slot_mapping: object  # [tokens], slot = block * block_size + offset
    block_tables: object  # [num_seqs, max_blocks], padded with 0
    cu_seqlens_q: object  # [num_seqs + 1]
    context_lens: object  # [num_seqs], cached tokens including this step's
    max_seqlen_q: int
    decodes: int = 0  # trailing sequences of one new token: attended by paged_attention (split-K)
    decode_context: int = 0  # the longest context among them

    @classmethod
    def from_chunks(cls, chunks, block_size: int) -> Batch:
        """chunks: [(new token ids, position of the first, block table)] per sequence. Built with a
        few whole-array operations: a step holds up to max_num_seqs chunks, and its host work
        between two eager forwards leaves the GPU idle."""
        q_lens = np.fromiter((len(t) for t, _, _ in chunks), np.int64, len(chunks))
        starts = np.fromiter((s for _, s, _ in chunks), np.int64, len(chunks))
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        seq_of = np.repeat(np.arange(len(chunks)), q_lens)
        positions = starts[seq_of] + np.arange(cu[-1]) - cu[:-1][seq_of]
        widths = np.fromiter((len(b) for _, _, b in chunks), np.int64, len(chunks))
        tables = np.zeros((len(chunks), widths.max()), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(b for _, _, b in chunks), np.int32, int(widths.sum()))
        slots = slot_mapping(tables, seq_of, positions, block_size)
        longer = np.flatnonzero(q_lens != 1)  # sequences of more than one new token
        decodes = len(chunks) - (int(longer[-1]) + 1 if len(longer) else 0)
        context_lens = (starts + q_lens).astype(np.int32)
        tokens = np.fromiter(itertools.chain.from_iterable(t for t, _, _ in chunks), np.int32, int(cu[-1]))
        return cls(token_ids=tokens, positions=positions.astype(np.int32), slot_mapping=slots,
                   block_tables=tables, cu_seqlens_q=cu.astype(np.int32),
                   context_lens=context_lens, max_seqlen_q=int(q_lens.max()), decodes=decodes,
                   decode_context=int(context_lens[len(chunks) - decodes:].max(initial=0)))

    def to(self, xp) -> Batch:
        host = ("max_seqlen_q", "decodes", "decode_context")
        arrays = {f.name: xp.asarray(getattr(self, f.name)) for f in fields(self) if f.name not in host}
        return Batch(**arrays, **{name: getattr(self, name) for name in host})


def input_views(buf, b: int, width: int) -> DecodeInputs:
    """DecodeInputs viewing one int32 buffer [b * (4 + width)] (numpy or cupy) in the layout above."""
    return DecodeInputs(token_ids=buf[:b], positions=buf[b:2 * b], slot_mapping=buf[2 * b:3 * b],
                        context_lens=buf[3 * b:4 * b], block_tables=buf[4 * b:].reshape(b, width))


def pack_inputs(buf, token_ids, positions, block_tables, block_size: int, scratch: int, b: int, width: int):
    """Write a step's inputs into the host buffer; rows len(token_ids)..b-1 are padding rows that
    decode token 0 at position 0 into block `scratch`."""
    n = len(token_ids)
    v = input_views(buf, b, width)
    v.token_ids[:n], v.token_ids[n:] = token_ids, 0
    v.positions[:n], v.positions[n:] = positions, 0
    v.block_tables[...] = 0
    for i, table in enumerate(block_tables):
        v.block_tables[i, :len(table)] = table
    v.block_tables[n:, 0] = scratch
    pos = v.positions
    v.slot_mapping[:] = slot_mapping(v.block_tables, np.arange(b), pos, block_size)
    v.context_lens[:] = pos + 1
