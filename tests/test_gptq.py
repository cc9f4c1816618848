"""GPTQ: the column-wise error feedback, its int4 format, the layer-by-layer calibration walk."""
import numpy as np
import pytest
from test_model import random_tensors, tiny_config

from cuinfer.errors import CuinferError
from cuinfer.eval import main as eval_main
from cuinfer.model.decoder import Model
from cuinfer.model.gptq import gptq, gptq_weights
from cuinfer.model.weights import LINEAR_FIELDS, fuse, to_device
from cuinfer.ops import quant


def correlated_inputs(rng, tokens, k, rank=48):
    """Activations that live near a low-rank subspace, as real ones do: where GPTQ beats rounding."""
    return rng.standard_normal((tokens, rank)) @ rng.standard_normal((rank, k)) + 0.1 * rng.standard_normal((tokens, k))


@pytest.mark.parametrize("group_size", quant.GROUP_SIZES)
def test_identity_hessian_is_round_to_nearest(group_size):
    """With H = I (no damping) no column passes error on: GPTQ is quantize(..., "minmax"), bit for bit."""
    w = np.random.default_rng(group_size).standard_normal((96, 384)).astype(np.float32)
    got, want = gptq(w, np.eye(384), group_size, damp=0.0, act_order=False), quant.quantize(w, "int4", group_size, "minmax")
    for f in ("qweight", "scales_zeros"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
    assert got.group_size == group_size and got.shape == (96, 384)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("group_size,k", [(128, 512), (64, 576), (32, 160)])
def test_output_error_below_round_to_nearest(group_size, k, act_order):
    """On correlated inputs the layer output error ||X (W - Wq)^T|| falls well below rounding's (the
    quantity GPTQ minimizes), and the stored grid is the one the feedback used: every weight stays
    within its group's int4 range."""
    rng = np.random.default_rng(k)
    w = rng.standard_normal((200, k)).astype(np.float32)
    x = correlated_inputs(rng, 4 * k, k)
    g, r = gptq(w, x.T @ x, group_size, act_order=act_order), quant.quantize(w, "int4", group_size, "minmax")
    err = {name: np.linalg.norm(x @ (q.dequantize() - w).T) for name, q in (("gptq", g), ("rtn", r))}
    assert err["gptq"] < 0.5 * err["rtn"], err
    q = g.unpack()
    assert q.max() <= 15 and np.isfinite(g.scales.astype(np.float32)).all() and (g.scales > 0).all()


def test_dead_inputs_get_zero_weights():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((512, 256))
    x[:, 5] = 0
    got = gptq(w, x.T @ x, 128).dequantize()
    assert np.all(got[:, 5] == 0)


def test_gptq_weights_quantizes_every_linear_and_beats_rounding():
    """The layer-by-layer walk: every decoder linear layer becomes an Int4Weight (576-style widths
    shrink the group), the caller's model keeps its float weights, and on calibration tokens the
    GPTQ model's logits are closer to the float model's than round-to-nearest's."""
    cfg = tiny_config(hidden_size=96, intermediate_size=160, head_dim=32, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=97)
    t = random_tensors(cfg)
    model = Model.from_tensors(cfg, t, "cpu")
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 3 * 64)
    seen = []
    w = gptq_weights(model, ids, group_size=128, seq_len=64, progress=seen.append)
    assert seen == list(range(cfg.num_hidden_layers))
    for lw, orig in zip(w.layers, model.weights.layers):
        for f in LINEAR_FIELDS:
            q = getattr(lw, f)
            assert isinstance(q, quant.Int4Weight) and q.group_size == quant.group_for(q.shape[1], 128)
            assert isinstance(getattr(orig, f), np.ndarray)  # the float model is untouched
    rtn = Model.from_tensors(cfg, t, "cpu", quant="int4")
    gq = Model(cfg, to_device(w, np, np.float32))

    from test_model import make_cache

    from cuinfer.eval import perplexity
    from cuinfer.model.step_inputs import Batch

    def logits(m):
        return m.forward(Batch.from_chunks([(ids[:64], 0, [0, 1, 2, 3])], 16), make_cache(cfg, m), all_logits=True)

    ref = logits(model)
    err = {name: np.linalg.norm(logits(m) - ref) for name, m in (("gptq", gq), ("rtn", rtn))}
    assert err["gptq"] < err["rtn"], err
    assert np.isfinite(perplexity(gq, ids[:128], window=64, stride=32)[0])


def test_gptq_is_not_a_load_time_format(tmp_path, capsys):
    assert quant.parse_spec("int4-g64-gptq") == ("int4", 64, "gptq")
    cfg = tiny_config()
    with pytest.raises(CuinferError, match="calibration"):
        to_device(fuse(cfg, random_tensors(cfg)), np, np.float32, "int4-gptq")
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert eval_main(["perplexity", str(tmp_path), "--text", str(text), "--quant", "int4-gptq", "--device", "cpu"]) == 2
    assert "needs --calib" in capsys.readouterr().err
