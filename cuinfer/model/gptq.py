"""GPTQ (Frantar et al., 2022): int4 weights fitted to calibration activations, on the CPU.

    weights = gptq_weights(model, calib_ids, group_size=128)   # model: the float32 numpy Model

Round-to-nearest (`quant.quantize`) minimizes each weight's own error; GPTQ minimizes the error
of the layer's output on real inputs X: quantizing column k of W leaves an error e (per output
row) that the columns not yet quantized absorb, w[:, j] -= e * Hinv[k, j] / Hinv[k, k] with
H = X^T X (+ 10% damping), in blocks of 128 columns (the "lazy batch" update). Columns go in
order of decreasing H[k, k] (act_order: the most active inputs first, while the most columns
are left to absorb their error); each group's (scale, zero) is then fitted up front with the
"minmax" rule, and without act_order as its first column comes up. The result is an ordinary
Int4Weight: same format, bytes and kernels as round-to-nearest; `python -m cuinfer.quantize SRC DST
--quant int4-gptq --calib FILE` saves them as a checkpoint.

gptq_weights walks the decoder layer by layer: the calibration tokens run through the layers
already quantized, the next layer's linear inputs (qkv, o, gate_up, down) give its four H, its
weights are quantized, and the layer is run again with them to feed the next one. (Quantizing
the four one after another, each on the inputs the quantized ones before it leave, measured no
better on the default model: docs/linear.md.)
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..ops import runtime
from ..ops.quant import GROUP_SIZES, QUANTIZED, Int4Weight, group_for, minmax_grid
from .weights import LINEAR_FIELDS

DAMP = 0.1  # of the mean diagonal of H, added to its diagonal (chosen on held-out text: docs/linear.md)
BLOCK = 128  # columns per lazy-batch block (a multiple of every group size)


def gptq(w, hessian, group_size: int = 128, damp: float = DAMP, act_order: bool = True) -> Int4Weight:
    """Int4Weight of w [N, K] (float) for inputs whose X^T X is `hessian` [K, K]. act_order: take the
    columns in order of decreasing H[k, k] (the most active inputs first, while the most columns
    are left to absorb their error), with each group's grid fitted up front on the original
    weights, since its columns are then spread over the whole pass."""
    W = np.array(w, dtype=np.float64)
    n, k = W.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"group_size: got {group_size}, need one of {GROUP_SIZES} dividing K = {k}")
    H = np.array(hessian, dtype=np.float64)
    if H.shape != (k, k):
        raise ValueError(f"hessian: got shape {H.shape}, need ({k}, {k})")
    dead = np.diag(H) == 0  # inputs that are always 0: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    H[np.diag_indices(k)] += damp * np.mean(np.diag(H))
    scales = np.zeros((n, k // group_size), dtype=np.float16)
    zeros = np.zeros_like(scales)
    order = np.arange(k)
    if act_order:
        for g in range(k // group_size):
            scales[:, g], zeros[:, g] = minmax_grid(W[:, g * group_size:(g + 1) * group_size])
        order = np.argsort(-np.diag(H), kind="stable")
        W, H = W[:, order], H[order][:, order]
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: H^-1 = U^T U, row j holds what column j passes on

    q = np.zeros((n, k), dtype=np.uint8)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        Wb, Ub = W[:, b0:b1], U[b0:b1, b0:b1]  # Wb: a view, updated in place
        err = np.zeros((n, b1 - b0))
        for i in range(b1 - b0):
            col = order[b0 + i]  # the weight column this one is
            g = col // group_size
            if not act_order and col % group_size == 0:  # fit the group on its columns as the feedback left them
                scales[:, g], zeros[:, g] = minmax_grid(Wb[:, i:i + group_size])
            s64, z64 = scales[:, g].astype(np.float64), zeros[:, g].astype(np.float64)
            qc = np.clip(np.rint(Wb[:, i] / s64 + z64), 0, 15)
            q[:, col] = qc
            e = (Wb[:, i] - (qc - z64) * s64) / Ub[i, i]
            Wb[:, i:] -= np.outer(e, Ub[i, i:])
            err[:, i] = e
        W[:, b1:] -= err @ U[b0:b1, b1:]
    return Int4Weight.pack(q, scales, zeros, group_size)


def gptq_weights(model, calib_ids, group_size: int = 128, seq_len: int = 512, block_size: int = 16,
                 progress=None):
    """The model's Weights with every decoder linear layer GPTQ-quantized to int4 (numpy arrays;
    .to_device() each for the GPU). model: float32 numpy Model (Model.from_tensors(..., "cpu"));
    calib_ids: token ids, cut into sequences of seq_len tokens; a matrix whose in_features
    group_size does not divide takes the largest group that does (quant.group_for).
    progress(layer index) is called after each layer."""
    from ..ops.embedding import embedding
    from .kv_cache import CacheShape, KVCache
    from .step_inputs import Batch

    if model.xp is not np or model.weights.embed.dtype != np.float32:
        raise runtime.CuinferError("GPTQ runs on the float32 CPU model: Model.from_tensors(config, tensors, 'cpu')")
    if isinstance(model.weights.layers[0].qkv, QUANTIZED):
        raise runtime.CuinferError("GPTQ quantizes float weights: this checkpoint is quantized already")
    ids = np.asarray(calib_ids, dtype=np.int32)
    n_seqs = len(ids) // seq_len
    if n_seqs == 0:
        raise runtime.CuinferError(f"calibration text: {len(ids)} tokens, need at least {seq_len}")
    cfg = model.config
    blocks = -(-seq_len // block_size)
    cache = KVCache(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size),
                    n_seqs * blocks, np.float32, np)
    chunks = [(ids[i * seq_len:(i + 1) * seq_len], 0, list(range(i * blocks, (i + 1) * blocks)))
              for i in range(n_seqs)]
    batch = Batch.from_chunks(chunks, block_size)

    weights = dataclasses.replace(model.weights, layers=list(model.weights.layers))
    model = type(model)(cfg, weights)  # the caller's model keeps its float weights
    attend = model.prefill_attention(batch)
    s = embedding(batch.token_ids, weights.embed)
    for i, lw in enumerate(weights.layers):
        inputs = {}
        model.layer(i, s, cache, attend, inputs.__setitem__)
        quantized = {}
        for name in LINEAR_FIELDS:
            x, w = inputs[name].astype(np.float64), getattr(lw, name)
            quantized[name] = gptq(w, x.T @ x, group_for(w.shape[1], group_size))
        weights.layers[i] = dataclasses.replace(lw, **quantized)
        s = model.layer(i, s, cache, attend)
        if progress is not None:
            progress(i)
    return weights


def gptq_model(config, tensors, calib_ids, group_size: int = 128, device: str = "cpu", dtype=None, progress=None):
    """A Model whose decoder linear layers are GPTQ int4 (calibrated on the float32 CPU model, then
    moved to `device` like any quantized weight), its lm_head int8 as Model.from_tensors does."""
    from .decoder import LM_HEAD_QUANT, Model, kernel_dtype
    from .weights import to_device

    weights = gptq_weights(Model.from_tensors(config, tensors, "cpu"), calib_ids, group_size, progress=progress)
    xp, dt = (np, np.float32) if device == "cpu" else (runtime.require_cupy(), kernel_dtype(config, dtype))
    return Model(config, to_device(weights, xp, dt, lm_head_quant=LM_HEAD_QUANT))
