"""Every architecture against transformers itself: a random-weight checkpoint saved by transformers
loads in cuinfer, whose NumPy float32 logits at every position equal transformers' float32 eager
logits. Prompts are longer than the sliding windows, and fed in chunks through the paged cache."""
import numpy as np
import pytest

from cuinfer.io.checkpoint import load_checkpoint
from cuinfer.model.decoder import Model
from cuinfer.model.step_inputs import Batch, DecodeInputs, slot_mapping

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
WINDOW = 8
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# architecture -> (transformers config class, its fields beyond SMALL)
CASES = {
    "llama3.2-tied": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "llama-head-dim": ("LlamaConfig", {"head_dim": 32}),
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-window": ("Qwen3Config", {"head_dim": 24, "use_sliding_window": True, "sliding_window": WINDOW,
                                     "max_window_layers": 2}),
    "phi3": ("Phi3Config", {"sliding_window": None, "original_max_position_embeddings": 256}),
    "phi3-window": ("Phi3Config", {"sliding_window": WINDOW, "original_max_position_embeddings": 256}),
    # longrope below original_max_position_embeddings (short factors; cos, sin times attention_factor)
    "phi3-longrope": ("Phi3Config", {"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                                     "rope_scaling": "longrope"}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1000000.0}}}),
}


def randomize(model, seed):
    """Weights of realistic scale (transformers' init leaves norms at 1 and weights tiny): linear
    N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.1^2) (Gemma's (1 + w): w = N(0, 0.1^2)),
    biases N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    gemma = "gemma" in model.config.model_type
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_((0 if gemma else 1) + 0.1 * r)
            elif name.endswith(".bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)


def longrope(half, seed=4):
    """A longrope rope_scaling of head_dim / 2 = half random factors: short ones near 1, long ones 1..8."""
    r = np.random.default_rng(seed)
    return {"rope_type": "longrope", "short_factor": (1 + 0.2 * r.random(half)).tolist(),
            "long_factor": (1 + 7 * r.random(half)).tolist()}


def save_case(name, path, **over):
    """(directory, transformers model): case `name` with random weights, saved by transformers."""
    cls, fields = CASES[name]
    fields = {**SMALL, **fields, **over}
    if fields.get("rope_scaling") == "longrope":  # factors for the case's head_dim
        fields["rope_scaling"] = longrope((fields.get("head_dim") or
                                           fields["hidden_size"] // fields["num_attention_heads"]) // 2)
    config = getattr(transformers, cls)(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed=1)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def prompt_ids(n=5 * WINDOW + 3):
    return np.random.default_rng(3).integers(3, SMALL["vocab_size"], size=(2, n))


def cuinfer_logits(model, config, ids, chunk):
    """Logits at every position of each row of ids, fed in chunks through a paged cache of 4-token
    blocks interleaved between the rows."""
    from test_model import make_cache, run_chunks

    seqs = [([i + j for j in range(0, 2 * (-(-len(s) // 4)), 2)], list(s)) for i, s in enumerate(ids)]
    return run_chunks(model, make_cache(config, model, num_blocks=2 * len(seqs[0][0]) + 2, block_size=4), seqs,
                      chunk)


def decode_logits(model, config, ids, n_prefill):
    """Logits of positions n_prefill.. of one sequence: ids[:n_prefill] through Model.forward, then one
    token a step through Model.decode (paged_attention with the new token's write fused), teacher forced."""
    from test_model import make_cache

    xp, bs = model.xp, 16
    table = np.arange(-(-len(ids) // bs), dtype=np.int32)[None, :]  # [1, blocks]
    cache = make_cache(config, model, num_blocks=table.shape[1], block_size=bs)
    model.forward(Batch.from_chunks([(ids[:n_prefill], 0, table[0].tolist())], bs).to(xp), cache)
    out = []
    for p in range(n_prefill, len(ids)):
        pos = np.array([p], np.int32)
        inputs = DecodeInputs(token_ids=xp.asarray([ids[p]], dtype=np.int32), positions=xp.asarray(pos),
                              slot_mapping=xp.asarray(slot_mapping(table, np.zeros(1, np.int64), pos, bs)),
                              block_tables=xp.asarray(table), context_lens=xp.asarray(pos + 1))
        logits = model.decode(inputs, cache, max_context_len=p + 1)
        out.append(logits.get() if xp is not np else logits)
    return np.concatenate(out)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return save_case(request.param, tmp_path_factory.mktemp(request.param))


def test_numpy_logits_equal_transformers(checkpoint):
    path, hf = checkpoint
    config, tensors = load_checkpoint(path)
    assert config.architecture == hf.config.architectures[0]
    model = Model.from_tensors(config, tensors, "cpu")
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()  # [2, n, vocab] float32
    for chunk in (7, 1000):
        for g, r in zip(cuinfer_logits(model, config, ids, chunk), ref):
            err = np.linalg.norm(g - r) / np.linalg.norm(r)
            assert err < 2e-6, f"chunk {chunk}: relative L2 error {err:.2e}"
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


def test_decode_steps_equal_forward(checkpoint):
    """Model.decode one token at a time past the windows (the decode step the engine's graphs run)
    gives the logits Model.forward gives for the same positions."""
    path, _ = checkpoint
    config, tensors = load_checkpoint(path)
    model = Model.from_tensors(config, tensors, "cpu")
    ids = prompt_ids()[0].tolist()
    want = cuinfer_logits(model, config, [ids], 1000)[0][WINDOW // 2:]
    np.testing.assert_allclose(decode_logits(model, config, ids, WINDOW // 2), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_logits_as_close_as_transformers_half(name, dtype, tmp_path):
    """fp16 / bf16 logits on the GPU (head_dim 64: the kernels' smallest) against transformers' float32:
    relative L2 error, largest error and top-1 agreement over all positions at least as good as
    transformers' own run in that dtype, within 1.5x on the errors (the two round differently)."""
    from cuinfer.ops import runtime

    path, hf = save_case(name, tmp_path / name, hidden_size=256, intermediate_size=512, head_dim=64)
    config, tensors = load_checkpoint(path)
    model = Model.from_tensors(config, tensors, "gpu", np.dtype(np.float16) if dtype == "float16" else runtime.bfloat16)
    ids = prompt_ids(3 * 64 + 5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
        half = hf.to(device, getattr(torch, dtype))(torch.as_tensor(ids, device=device)).logits.float().cpu().numpy()
    got = np.stack(cuinfer_logits(model, config, ids, 64))
    err = lambda x: np.linalg.norm(x - ref) / np.linalg.norm(ref)
    worst = lambda x: np.abs(x - ref).max()
    top1 = lambda x: (x.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{name} {dtype}: cuinfer {err(got):.2e} (max {worst(got):.2e}) top-1 {top1(got):.3f}, "
          f"transformers {err(half):.2e} (max {worst(half):.2e}) top-1 {top1(half):.3f}")
    assert np.isfinite(got).all()
    assert err(got) <= 1.5 * err(half) and worst(got) <= 1.5 * worst(half) and top1(got) >= top1(half) - 0.02


def test_longrope_long_factors_past_the_original_length(tmp_path):
    """Phi-3 longrope with original_max_position_embeddings 32: a prompt of 43 in one forward rotates
    with the long factors as transformers' does; one of 30 with the short ones; and 30 then 13 more
    tokens on the cache (the 13 long, the cached 30 short) equal transformers' forward on its cache."""
    path, hf = save_case("phi3-longrope", tmp_path / "m", original_max_position_embeddings=32,
                         max_position_embeddings=128)
    config, tensors = load_checkpoint(path)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.attention_scale == pytest.approx(16 ** -0.5 * (1 + np.log(4) / np.log(32)))
    model = Model.from_tensors(config, tensors, "cpu")
    ids = prompt_ids()  # [2, 43]

    def check(got, ref):
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 2e-6, f"relative L2 error {err:.2e}"

    with torch.no_grad():
        for n in (43, 30):
            ref = hf(torch.as_tensor(ids[:, :n])).logits.numpy()
            for g, r in zip(cuinfer_logits(model, config, ids[:, :n], 1000), ref):
                check(g, r)
        first = hf(torch.as_tensor(ids[:, :30]), use_cache=True)
        ref = hf(torch.as_tensor(ids[:, 30:]), past_key_values=first.past_key_values).logits.numpy()
    for g, r in zip(cuinfer_logits(model, config, ids, 30), ref):
        check(g[30:], r)


@pytest.mark.parametrize("name", ["llama3.2-tied", "qwen2-window", "qwen3", "phi3", "gemma2", "gemma3"])
def test_decode_bench_peer_gets_our_weights(name, tmp_path):
    """bench decode's transformers peer: our fused weights under the architecture's Hugging Face
    names (split rows, Gemma's norms back to w) give a fresh transformers model the original logits."""
    from cuinfer.benches.decode import hf_state_dict
    from cuinfer.model.weights import fuse, to_device

    path, hf = save_case(name, tmp_path / name)
    config, tensors = load_checkpoint(path)
    sd = hf_state_dict(torch, config, to_device(fuse(config, tensors), np, np.float32))
    fresh = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    fresh.load_state_dict(sd, strict=not config.tie_word_embeddings)
    ids = torch.as_tensor(prompt_ids())
    with torch.no_grad():
        np.testing.assert_allclose(fresh(ids).logits.numpy(), hf(ids).logits.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_decode_steps_match_numpy(name, dtype, tmp_path):
    """The GPU decode step (paged_attention with the fused write, windows, caps; the GEMV epilogues)
    one token at a time past 64-token windows, against the NumPy backend's forward: relative L2 error
    of the logits within test_model's GPU bound (set for 30 layers; these have 3)."""
    from test_model import GPU_LOGIT_REL_L2

    from cuinfer.ops import runtime

    path, _ = save_case(name, tmp_path / name, hidden_size=256, intermediate_size=512, head_dim=64,
                        sliding_window=64)
    config, tensors = load_checkpoint(path)
    dt = np.dtype(np.float16) if dtype == "float16" else runtime.bfloat16
    ids = prompt_ids(3 * 64 + 5)[0].tolist()
    want = cuinfer_logits(Model.from_tensors(config, tensors, "cpu"), config, [ids], 1000)[0][40:]
    got = decode_logits(Model.from_tensors(config, tensors, "gpu", dt), config, ids, 40)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{name} {dtype}: decode logits relative L2 error {err:.2e}")
    assert np.isfinite(got).all() and err <= GPU_LOGIT_REL_L2[dt]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_longrope_crossing_matches_numpy(dtype, tmp_path):
    """Phi-3 longrope with original_max_position_embeddings 64 on the GPU: a 40-token prefill, then
    decode steps past 64 (short, then long frequencies per row; write_kv before paged_attention), and a
    one-chunk forward of all 197 tokens (long), against the NumPy backend run the same way."""
    from test_model import GPU_LOGIT_REL_L2

    from cuinfer.ops import runtime

    path, _ = save_case("phi3-longrope", tmp_path / "m", hidden_size=256, intermediate_size=512, head_dim=64,
                        original_max_position_embeddings=64, max_position_embeddings=512)
    config, tensors = load_checkpoint(path)
    dt = np.dtype(np.float16) if dtype == "float16" else runtime.bfloat16
    cpu, gpu = Model.from_tensors(config, tensors, "cpu"), Model.from_tensors(config, tensors, "gpu", dt)
    ids = prompt_ids(3 * 64 + 5)[0].tolist()
    for got, want in ((decode_logits(gpu, config, ids, 40), decode_logits(cpu, config, ids, 40)),
                      (cuinfer_logits(gpu, config, [ids], 1000)[0], cuinfer_logits(cpu, config, [ids], 1000)[0])):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        print(f"longrope {dtype}: relative L2 error {err:.2e}")
        assert np.isfinite(got).all() and err <= GPU_LOGIT_REL_L2[dt]


@pytest.mark.parametrize("name", ["qwen3", "phi3-longrope"])
def test_batched_decode_steps_equal_forward(name, tmp_path):
    """Model.decode over padded rows of three sequences (q/k, v views of each qkv row; longrope: one
    short row, two past original_max_position_embeddings 16) equals Model.forward's logits."""
    from test_model import make_cache

    from cuinfer.model.step_inputs import input_views, pack_inputs

    extra = {"original_max_position_embeddings": 16, "max_position_embeddings": 128} if "longrope" in name else {}
    path, _ = save_case(name, tmp_path / name, **extra)
    config, tensors = load_checkpoint(path)
    model = Model.from_tensors(config, tensors, "cpu")
    rng = np.random.default_rng(4)
    ids = [rng.integers(3, SMALL["vocab_size"], n).tolist() for n in (5, 19, 33)]
    tables = [[1], list(range(2, 7)), list(range(10, 19))]  # 4-token blocks; 23 is the scratch block
    caches = [make_cache(config, model, num_blocks=24, block_size=4) for _ in range(2)]
    prefix = Batch.from_chunks([(s[:-3], 0, tb) for tb, s in zip(tables, ids)], 4)
    for c in caches:
        model.forward(prefix, c)
    b, width = 4, 9
    buf = np.zeros(b * (4 + width), np.int32)
    for j in range(3, 0, -1):
        pos = [len(s) - j for s in ids]
        ref = model.forward(Batch.from_chunks([([s[p]], p, tb) for s, p, tb in zip(ids, pos, tables)], 4), caches[0])
        pack_inputs(buf, [s[p] for s, p in zip(ids, pos)], pos, tables, 4, 23, b, width)
        got = model.decode(input_views(buf, b, width), caches[1], max_context_len=max(pos) + 1)[:3]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3-longrope"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("write", ["fused", "separate"])
def test_gpu_graph_decode_matches_numpy(name, dtype, write, tmp_path, cp, monkeypatch):
    """Decode steps replayed from CUDA graphs (the q/k norms, RoPE with longrope's per-row frequencies
    and the K/V write fused into paged_attention, or done by write_kv first as steps of
    SEPARATE_WRITE_ROWS rows do) for three sequences of different lengths (longrope: one short, two
    past original_max_position_embeddings 64), against the NumPy backend's forward of the same
    tokens; the captures take nothing from the pool beyond their warm-up."""
    from test_model import GPU_LOGIT_REL_L2, make_cache

    from cuinfer.model import decoder
    from cuinfer.ops import runtime
    from cuinfer.serving.runner import DecodeGraph

    if write == "separate":
        monkeypatch.setattr(decoder, "SEPARATE_WRITE_ROWS", 1)

    extra = {"original_max_position_embeddings": 64, "max_position_embeddings": 512} if "longrope" in name else {}
    path, _ = save_case(name, tmp_path / name, hidden_size=256, intermediate_size=512, head_dim=64, **extra)
    config, tensors = load_checkpoint(path)
    dt = np.dtype(np.float16) if dtype == "float16" else runtime.bfloat16
    cpu, gpu = Model.from_tensors(config, tensors, "cpu"), Model.from_tensors(config, tensors, "gpu", dt)
    rng = np.random.default_rng(4)
    ids = [rng.integers(3, SMALL["vocab_size"], n).tolist() for n in (9, 70, 130)]
    tables = [[1], list(range(2, 7)), list(range(10, 19))]  # 16-token blocks; 23 is the scratch block
    cpu_cache, gpu_cache = make_cache(config, cpu, num_blocks=24), make_cache(config, gpu, num_blocks=24)
    graphs = DecodeGraph(gpu, gpu_cache, 23)
    prefix = Batch.from_chunks([(s[:-4], 0, tb) for tb, s in zip(tables, ids)], 16)
    cpu.forward(prefix, cpu_cache)
    gpu.forward(prefix.to(cp), gpu_cache)
    for j in range(4, 0, -1):
        pos = [len(s) - j for s in ids]
        ref = cpu.forward(Batch.from_chunks([([s[p]], p, tb) for s, p, tb in zip(ids, pos, tables)], 16), cpu_cache)
        got = graphs.run([s[p] for s, p in zip(ids, pos)], pos, tables, greedy=False).get()
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"{name} {dtype}: graph decode logits relative L2 error {err:.2e}")
        assert np.isfinite(got).all() and err <= GPU_LOGIT_REL_L2[dt]
    assert graphs.steps and all(s.capture_bytes == 0 for s in graphs.steps.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2-window", "qwen3", "gemma2", "gemma3", "phi3-longrope"])
def test_gpu_piecewise_steps_match_numpy(name, tmp_path, cp):
    """Eager steps through the piecewise graphs (serving.piecewise: every layer's o projection, MLP and
    next normed projection in a graph, the attention eager between them) for each architecture's
    block: a prefill of three sequences, then a mixed step (a chunk and two decodes) and a step of
    16 tokens or fewer (the GEMV's fused norms and output-norm adds), fp16, against the NumPy
    backend, the static buffers poisoned with NaN before each step (longrope: past
    original_max_position_embeddings 64)."""
    from test_model import GPU_LOGIT_REL_L2, make_cache

    from cuinfer.serving.piecewise import PiecewiseForward

    extra = {"original_max_position_embeddings": 64, "max_position_embeddings": 512} if "longrope" in name else {}
    path, _ = save_case(name, tmp_path / name, hidden_size=256, intermediate_size=512, head_dim=64, **extra)
    config, tensors = load_checkpoint(path)
    cpu, gpu = Model.from_tensors(config, tensors, "cpu"), Model.from_tensors(config, tensors, "gpu", np.float16)
    rng = np.random.default_rng(5)
    ids = [rng.integers(3, SMALL["vocab_size"], n).tolist() for n in (20, 90, 130)]
    tables = [[1, 2], list(range(3, 9)), list(range(10, 19))]
    cpu_cache, gpu_cache = make_cache(config, cpu, num_blocks=24), make_cache(config, gpu, num_blocks=24)
    steps = PiecewiseForward(gpu, gpu_cache, 256)
    steps.capture_all()
    for chunks in ([(s[:n], 0, tb) for s, n, tb in zip(ids, (12, 60, 100), tables)],  # 172 tokens
                   [(ids[2][100:129], 100, tables[2]), (ids[0][12:13], 12, tables[0]), (ids[1][60:61], 60, tables[1])],
                   [(ids[0][13:20], 13, tables[0]), (ids[1][61:62], 61, tables[1])]):  # 8 tokens
        batch = Batch.from_chunks(chunks, 16)
        ref = cpu.forward(batch, cpu_cache)
        for a in (steps.s, steps.a, steps.qkv):
            a.fill(np.nan)
        got = steps.forward(batch.to(cp)).get()
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert np.isfinite(got).all() and err <= GPU_LOGIT_REL_L2[np.dtype(np.float16)], (len(batch.token_ids), err)
    assert len(steps.graphs) == 12  # every bucket to 256 tokens, replayed


def test_arch_records_are_well_formed():
    """Every family's record: the four linear fields, norms among the layer's norm fields (the two
    pre-norms always), each Hugging Face architecture in one record, GGUF names onto tensors it has."""
    from cuinfer.convert import load_preset
    from cuinfer.io.checkpoint import expected_tensors
    from cuinfer.model.arch import ARCHES, LINEAR_FIELDS, NORM_FIELDS

    presets = {"LlamaForCausalLM": "tiny", "MistralForCausalLM": "mistral-7b", "Qwen2ForCausalLM": "tiny-qwen2",
               "Qwen3ForCausalLM": "tiny-qwen3", "Phi3ForCausalLM": "tiny-phi3", "Gemma2ForCausalLM": "tiny-gemma2",
               "Gemma3ForCausalLM": "gemma3-12b-text"}
    assert set(presets) == set(ARCHES)
    for name, arch in ARCHES.items():
        config = load_preset(presets[name]).replace(architecture=name, tie_word_embeddings=False)
        assert tuple(arch.linear(config)) == LINEAR_FIELDS
        assert {"attn_norm", "mlp_norm"} <= set(arch.norms) <= set(NORM_FIELDS)
        names = expected_tensors(config)
        for hf in arch.gguf_names.values():
            assert hf.format(i=0) in names or (hf.endswith(".bias") and not config.attention_bias), (name, hf)
