"""The decoder of every architecture in cuinfer.model.arch, written once over cuinfer.ops.

The array module comes from the weights: numpy weights run every op's NumPy
reference (the CPU backend, float32), CuPy weights launch the kernels (fp16/bf16).

A step takes a flat batch of tokens from any number of sequences: a prompt chunk
(prefill) and a single token (decode) are the same thing, a sequence's q_len new
tokens at positions context_len - q_len .. context_len - 1. Per layer, on the residual stream s
(the embedding before the first layer):

    qkv = rms_norm(s) @ w_qkv.T (+ b)             one projection for q, k, v; the norm in the GEMV
    q = write_kv(q, k, v, ...)                    (q/k norms,) RoPE on q and k, k/v into the paged cache
    a = attention(q, cache, ...)                  causal GQA over the cache (decode below
                                                  SEPARATE_WRITE_ROWS: one kernel with write_kv)
    s = a @ w_o.T + s                             the residual add in the GEMV's epilogue
    s = gated_mlp(rms_norm(s), w_gate_up) @ w_down.T + s    silu(gate) * up fused in the GEMV

What the architecture adds is data (cuinfer.model.arch and the config): q/k/v biases; an RMSNorm
over each q and k head before RoPE (Qwen3, Gemma 3); norms on the attention and MLP outputs before
their residual adds (Gemma: the add then in rms_norm's add_to, not the GEMV); GELU-tanh for SiLU;
the embedding times sqrt(hidden); a sliding window, a RoPE base and a score cap per layer; the
attention scale; longrope's short or long frequencies per sequence (Phi-3); a cap on the final
logits (cap * tanh(x / cap)).

then the lm_head of the final norm (fused the same way) on the last token of each sequence (or
every token). On the GPU the norms and residual adds launch nothing of their own at decode sizes
(ops.linear's norm= and residual=).
`forward` attends with flash_attention_paged (any mix of prefill chunks and decodes);
`decode` (one token per sequence, the step cuinfer.serving.runner captures) with the split-K
paged_attention over static inputs, and can end in the argmax (greedy) instead of logits. The
steps' inputs (Batch, DecodeInputs) are in cuinfer.model.step_inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops import runtime
from ..ops.embedding import embedding
from ..ops.flash_attention import flash_attention_paged
from ..ops.linear import GATED, KERNEL_DTYPES, linear, linear_argmax, linear_reference, path, weight_bits
from ..ops.paged_attention import paged_attention, workspace_elems
from ..ops.quant import QUANTIZED
from ..ops.rms_norm import rms_norm
from ..ops.rope import rope_inv_freq
from ..ops.write_kv import write_kv
from .step_inputs import Batch, DecodeInputs
from .weights import LINEAR_FIELDS, Weights, fuse, nonfinite_tensor, to_device

LM_HEAD_QUANT = "int8"  # the lm_head's format whenever the linear layers are quantized
GATED_EPILOGUE = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_and_mul"}  # hidden_act -> ops.linear.GATED
SEPARATE_WRITE_ROWS = 96  # decode steps of at least this many rows write K/V (write_kv) before the plain attention


def project(x, w, bias=None, norm=None, residual=None, out=None):
    """y = x @ w.T (+ bias) (+ residual) for x: [rows, in], w: [out, in] (float or quantized), with
    x replaced by rms_norm(x, *norm) when norm = (weight, eps) is given; into `out` if given."""
    if x.dtype in KERNEL_DTYPES:
        return linear(x, w, bias, out=out, norm=norm, residual=residual)
    y = linear_reference(x if norm is None else rms_norm(x, *norm), w, bias)  # float32 (CPU backend)
    y = y if residual is None else y + residual
    if out is None:
        return y
    out[...] = y
    return out


def gated_mlp(x, w_gate_up, act, norm=None):
    """act(x @ w_gate.T) * (x @ w_up.T): [rows, intermediate] from the stacked [gate; up] weight, x
    normed as in project; act is config.hidden_act (SiLU or GELU-tanh). GPU: the GEMV's fused
    epilogue; float32 CPU: the product, then ops.silu_and_mul / gelu_and_mul."""
    epilogue = GATED_EPILOGUE[act]
    if x.dtype in KERNEL_DTYPES:
        return linear(x, w_gate_up, activation=epilogue, norm=norm)
    return GATED[epilogue][1](project(x, w_gate_up, norm=norm))


def softcap(x, cap):
    """cap * tanh(x / cap) (Gemma 2's logit cap); x itself when cap is None."""
    if cap is None:
        return x
    xp = runtime.require_cupy() if runtime.is_device_array(x) else np
    return xp.tanh(x / np.float32(cap)) * np.float32(cap)


def greedy_tokens(x, w_head, norm=None, out=None):
    """int32 [rows] (into `out` if given): argmax of x @ w_head.T, x normed as in project (the
    lm_head; GPU: one fused GEMV + reduction)."""
    if x.dtype in KERNEL_DTYPES:
        return linear_argmax(x, w_head, out=out, norm=norm)
    tokens = np.argmax(project(x, w_head, norm=norm), axis=-1).astype(np.int32)
    if out is None:
        return tokens
    out[...] = tokens
    return out


@dataclass
class Deferred:
    """The residual stream s + rms_norm(y, weight) with that add not yet done (Gemma's output norms):
    the next normed projection does it in its GEMV's prologue (ops.linear's add), so the norm costs
    no launch of its own at decode (Model.normed); Model.resolve does it where nothing can.
    weight None: s + y, a residual add the GEMM's epilogue does not fuse (cuBLAS rows), done by the
    next pre-norm's launch (ops.rms_norm's residual form) instead of one of its own."""
    s: object
    y: object
    weight: object


def kernel_dtype(config, dtype=None):
    """The GPU compute dtype: as asked, else the checkpoint's bf16, else fp16."""
    if dtype is not None:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float16), runtime.bfloat16):
            raise runtime.CuinferError(f"--dtype {dt}: the GPU attention kernels need float16 or bfloat16")
        return dt
    return runtime.bfloat16 if str(config.torch_dtype) == "bfloat16" else np.dtype(np.float16)


class Model:
    def __init__(self, config, weights: Weights):
        self.config = config
        self.weights = weights
        self.xp = runtime.require_cupy() if runtime.is_device_array(weights.embed) else np
        self.dtype = weights.embed.dtype
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # Gemma's sqrt(hidden), rounded to the model dtype as transformers rounds it
        scale = np.float32(config.hidden_size ** 0.5 if config.arch.embed_scale else 1.0)
        self.embed_scale = float(scale.astype(self.dtype))
        full = rope_inv_freq(self.head_dim, config.rope_theta, config.rope_scaling)
        local = full if config.rope_local_base_freq is None else \
            rope_inv_freq(self.head_dim, config.rope_local_base_freq)
        freqs = {id(f): self.xp.asarray(np.asarray(f, dtype=np.float32)) for f in (full, local)}
        # per layer: inv_freq (sliding layers may have their own base), window (0: full)
        self.inv_freq = [freqs[id(local if config.window(i) else full)] for i in range(config.num_hidden_layers)]
        # longrope (Phi-3): (context length past which a sequence's step rotates with the long
        # factors, those frequencies); the short ones are self.inv_freq
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "longrope" and config.rope_local_base_freq is not None:
            raise runtime.CuinferError("config: longrope with a local RoPE base per layer is not supported")
        self.longrope = None if scaling.get("rope_type") != "longrope" else (
            scaling["original_max_position_embeddings"],
            self.xp.asarray(rope_inv_freq(self.head_dim, config.rope_theta, scaling, long=True)))
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]
        if self.xp is np:  # the CPU backend multiplies by the dequantized weights: make them once, now
            for w in [weights.lm_head] + [getattr(lw, f) for lw in weights.layers for f in LINEAR_FIELDS]:
                if isinstance(w, QUANTIZED):
                    w.dequantize()

    @classmethod
    def from_tensors(cls, config, tensors, device="cpu", dtype=None, quant=None) -> Model:
        """device "cpu": numpy float32; "gpu": CuPy in `dtype` (default from the checkpoint).
        quant (a quant.parse_spec string) quantizes the decoder's linear layers, and the lm_head
        to LM_HEAD_QUANT."""
        fused = fuse(config, tensors)
        head = LM_HEAD_QUANT if quant else None
        xp, dt = (np, np.float32) if device == "cpu" else (runtime.require_cupy(), kernel_dtype(config, dtype))
        weights = to_device(fused, xp, dt, quant, head)
        bad = nonfinite_tensor(config, weights)
        if bad is not None:
            raise runtime.CuinferError(f"checkpoint: {bad} holds NaN or Inf values")
        return cls(config, weights)

    def attention_kwargs(self, i: int) -> dict:
        """Layer i's attention arguments beyond the tensors: scale, window, score cap."""
        return {"scale": self.config.attention_scale, "window": self.windows[i],
                "softcap": self.config.attn_logit_softcapping}

    def logits(self, s):
        """float32 logits of the residual stream rows s: the lm_head of the final norm, capped."""
        logits = project(s, self.weights.lm_head, norm=self.final_norm).astype(np.float32)
        return softcap(logits, self.config.final_logit_softcapping)

    def forward(self, batch: Batch, kv_cache, all_logits: bool = False):
        """float32 logits [num_seqs, vocab] of each sequence's last token ([tokens, vocab] if all_logits).
        Attention: flash_attention_paged (any q_len per sequence: prefill chunks and decodes)."""
        s = self.hidden(batch.token_ids, kv_cache, self.prefill_attention(batch))
        if not all_logits:
            s = s[batch.cu_seqlens_q[1:] - 1]  # s: [num_seqs, hidden]
        return self.logits(s)

    def decode(self, inputs: DecodeInputs, kv_cache, max_context_len: int, workspace=None, greedy=False,
               tokens_out=None, verify=0):
        """One new token per row (the step DecodeGraph captures): paged_attention (split-K) with
        `max_context_len` an upper bound of context_lens, so nothing is read back to the host.
        Returns float32 logits [rows, vocab], or with greedy the int32 argmax [rows], written into
        tokens_out if given (which may be inputs.token_ids: the embedding has read them by then).
        Each row is its own sequence, and RoPE and the cache write are fused into the attention;
        with verify=q (a verify step), rows i*q .. i*q + q - 1 are consecutive tokens of one sequence,
        each row with its own position, context_lens and block-table row: the attention writes each
        row's K/V and those of its chunk's rows before it, then the row attends over its context
        (paged_attention's chunk_rows). Longrope rotates each row with its own frequencies (a row
        of them per q row); q/k norms are fused like RoPE."""
        freqs = self.step_inv_freq(inputs.context_lens)  # None, or longrope's [rows, head_dim / 2]

        def attend(i, q, k, v, k_cache, v_cache):
            return self.decode_attention(i, q, k, v, k_cache, v_cache, inputs, freqs, max_context_len, workspace,
                                         verify)

        s = self.hidden(inputs.token_ids, kv_cache, attend)
        if greedy:  # the cap on the logits keeps their order
            return greedy_tokens(s, self.weights.lm_head, norm=self.final_norm, out=tokens_out)
        return self.logits(s)

    def decode_attention(self, i, q, k, v, k_cache, v_cache, inputs: DecodeInputs, freqs, max_context_len: int,
                         workspace=None, verify=0):
        """Layer i's attention in a decode step (decode's): q, k, v the rows' heads as the qkv GEMV wrote
        them; q/k norms, RoPE (the layer's frequencies, or with longrope freqs, a row per q row) and the
        cache write fused into paged_attention, or from SEPARATE_WRITE_ROWS rows on done by write_kv
        first (the same bits; there the fused call's coherent re-reads of the new rows cost more than
        the extra launch). Its arrays come from the caller's pool (DecodeGraph's, Verifier's)."""
        kw = dict(out=self.xp.empty(q.shape, q.dtype), max_context_len=max_context_len, workspace=workspace,
                  **self.attention_kwargs(i))
        if q.shape[0] >= SEPARATE_WRITE_ROWS:
            q = self.write_kv(i, q, k, v, inputs.positions, k_cache, v_cache, inputs.slot_mapping, freqs,
                              out=self.xp.empty(q.shape, q.dtype))
            return paged_attention(q, k_cache, v_cache, inputs.block_tables, inputs.context_lens, **kw)
        lw = self.weights.layers[i]
        norm = None if lw.q_norm is None else (lw.q_norm, lw.k_norm, self.config.rms_norm_eps)
        new_kv = (k, v, inputs.slot_mapping, self.inv_freq[i] if freqs is None else freqs)
        return paged_attention(q, k_cache, v_cache, inputs.block_tables, inputs.context_lens, new_kv=new_kv,
                               qk_norm=norm, chunk_rows=verify or 1, **kw)

    def decode_workspace_elems(self, batch: int, max_context_len: int) -> int:
        """float32 elements of the split-K partials a decode step of this shape needs (0: none)."""
        return workspace_elems(batch, self.n_heads, self.n_kv_heads, self.head_dim, max_context_len)

    @property
    def final_norm(self):
        return self.weights.norm, self.config.rms_norm_eps

    def prefill_attention(self, batch: Batch):
        """`forward`'s attend (its `out`, [tokens, n_heads, head_dim], optional): write_kv (q/k norms,
        RoPE on q and k, k and v into the cache), then flash_attention_paged over each sequence's
        cached prefix and new tokens; the batch's trailing one-token sequences (`Batch.decodes`: the
        decodes of a mixed step) through paged_attention, the split-K decode kernel, instead (a
        prefill tile would hold one query row of each)."""
        freqs = None
        if self.longrope is not None:  # each token gets its sequence's context length
            xp, tokens = self.xp, len(batch.positions)
            seq = xp.searchsorted(xp.asarray(batch.cu_seqlens_q[1:]), xp.arange(tokens), side="right")
            freqs = self.step_inv_freq(xp.asarray(batch.context_lens)[seq])

        chunks = batch.block_tables.shape[0] - batch.decodes  # sequences before the decodes
        rows = len(batch.token_ids) - batch.decodes  # their tokens

        def attend(i, q, k, v, k_cache, v_cache, out=None):  # q, k, v: views of the qkv rows
            q = self.write_kv(i, q, k, v, batch.positions, k_cache, v_cache, batch.slot_mapping, freqs,
                              out=self.xp.empty(q.shape, q.dtype))
            kw = self.attention_kwargs(i)
            out = self.xp.empty(q.shape, q.dtype) if out is None else out
            if chunks:
                flash_attention_paged(q[:rows], k_cache, v_cache, batch.block_tables[:chunks],
                                      batch.cu_seqlens_q[:chunks + 1], batch.context_lens[:chunks], out=out[:rows],
                                      max_seqlen_q=batch.max_seqlen_q, **kw)
            if batch.decodes:
                paged_attention(q[rows:], k_cache, v_cache, batch.block_tables[chunks:], batch.context_lens[chunks:],
                                out=out[rows:], max_context_len=batch.decode_context, **kw)
            return out
        return attend

    def write_kv(self, i, q, k, v, positions, k_cache, v_cache, slots, freqs, out):
        """Layer i's write_kv: q/k norms where the layer has them (fused), RoPE with `freqs` (a row
        per token, longrope) or the layer's frequencies."""
        lw = self.weights.layers[i]
        return write_kv(q, k, v, positions, k_cache, v_cache, slots, self.inv_freq[i] if freqs is None else freqs,
                        out=out, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=self.config.rms_norm_eps)

    def step_inv_freq(self, context_lens):
        """longrope: float32 [rows, head_dim / 2], the long frequencies for the rows whose sequence
        holds more than original_max_position_embeddings tokens after this step, else the short ones
        (transformers' rule for one forward: the long ones once the sequence is longer; keys cached
        before a sequence crosses over keep their short rotation). None without longrope."""
        if self.longrope is None:
            return None
        orig, long = self.longrope
        return self.xp.where((context_lens > orig)[:, None], long[None, :], self.inv_freq[0][None, :]
                             ).astype(np.float32)

    def hidden(self, token_ids, kv_cache, attend):
        """The residual stream after the last layer [tokens, hidden] (not normed: the lm_head call
        applies final_norm); attend(i, q, k, v, k_cache, v_cache) -> [tokens, n_heads, head_dim], layer
        i's q and k not yet normed (q/k norm) nor rotated."""
        s = embedding(token_ids, self.weights.embed, scale=self.embed_scale)  # s: [tokens, hidden]
        for i in range(len(self.weights.layers)):
            s = self.layer(i, s, kv_cache, attend)
        return self.resolve(s)

    def layer(self, i, s, kv_cache, attend, observe=None):
        """Decoder layer i on the residual stream s (or a Deferred one): returns the next s, Deferred
        with output norms (Gemma). observe(name, x), if given, sees the input of each linear layer
        ("qkv", "o", "gate_up", "down"), as GPTQ calibration needs."""
        qkv, s = self.pre_attention(i, s, observe=observe)
        a = attend(i, *self.split_qkv(qkv), *kv_cache.layer(i))
        return self.post_attention(i, a.reshape(qkv.shape[0], -1), s, observe)

    def pre_attention(self, i, s, qkv_out=None, observe=None):
        """(qkv, s): layer i's normed q, k, v projection [tokens, (n_heads + 2 n_kv_heads) head_dim]
        (into qkv_out if given) and the residual stream, any Deferred add done."""
        lw = self.weights.layers[i]
        if observe:
            s = self.resolve(s)
            observe("qkv", rms_norm(s, lw.attn_norm, self.config.rms_norm_eps))
        return self.normed(s, lw.qkv, (lw.attn_norm, self.config.rms_norm_eps), lw.qkv_bias, out=qkv_out)

    def split_qkv(self, qkv) -> tuple:
        """(q, k, v): the heads of each row of qkv, views (q and k not yet normed nor rotated)."""
        tokens, d = qkv.shape[0], self.head_dim
        nq, nkv = self.n_heads * d, self.n_kv_heads * d
        return (qkv[:, :nq].reshape(tokens, self.n_heads, d), qkv[:, nq:nq + nkv].reshape(tokens, self.n_kv_heads, d),
                qkv[:, nq + nkv:].reshape(tokens, self.n_kv_heads, d))

    def post_attention(self, i, a, s, observe=None):
        """Layer i after its attention a [tokens, n_heads head_dim]: the o projection and the MLP on
        the residual stream s; returns the next s (Deferred as `layer`'s)."""
        lw, eps = self.weights.layers[i], self.config.rms_norm_eps
        s = self.residual(a, lw.o, lw.attn_out_norm, s)
        if observe:
            s = self.resolve(s)
            observe("o", a)
            observe("gate_up", rms_norm(s, lw.mlp_norm, eps))
        act, s = self.normed(s, lw.gate_up, (lw.mlp_norm, eps), act=self.config.hidden_act)
        if observe:
            observe("down", act)
        return self.residual(act, lw.down, lw.mlp_out_norm, s)

    def residual(self, x, w, out_norm, s):
        """s + x @ w.T, or with an output norm (Gemma) s + rms_norm(x @ w.T), Deferred; on the
        device's cuBLAS path (no fused epilogue) s + x @ w.T Deferred too."""
        if out_norm is None:
            if x.dtype in KERNEL_DTYPES and path(weight_bits(w), x.shape[0]) == "cublas":
                return Deferred(s, project(x, w), None)
            return project(x, w, residual=s)  # the add in the GEMV's epilogue
        return Deferred(s, project(x, w), out_norm)

    def resolve(self, s):
        """The residual stream s, its Deferred add done (ops.rms_norm's add_to)."""
        if not isinstance(s, Deferred):
            return s
        if s.weight is None:
            s.s += s.y  # T(T(y) + s): the rounding of the add the epilogue would have done
            return s.s
        return rms_norm(s.y, s.weight, self.config.rms_norm_eps, add_to=s.s)

    def normed(self, s, w, norm, bias=None, act=None, out=None):
        """(y, s): y = rms_norm(s, *norm) @ w.T (+ bias), or with act gated_mlp's product, and the
        residual stream s, a Deferred add done on the way (in the GEMV's prologue on the GPU; a plain
        add in the norm's launch: rms_norm's residual form, as rounded as the add then the norm).
        out: y's array (projections only, not act)."""
        if isinstance(s, Deferred) and s.weight is None:
            x, s = rms_norm(s.y, *norm, residual=s.s, out=(s.y, s.s))  # x: rms_norm(s + y); s: s + y
            return (gated_mlp(x, w, act) if act else project(x, w, bias, out=out)), s
        if not isinstance(s, Deferred) or s.s.dtype not in KERNEL_DTYPES:
            s = self.resolve(s)
            return (gated_mlp(s, w, act, norm=norm) if act else project(s, w, bias, norm=norm, out=out)), s
        kw = {"activation": GATED_EPILOGUE[act]} if act else {}
        return linear(s.s, w, bias, out=out, norm=norm, add=(s.y, s.weight), **kw)
