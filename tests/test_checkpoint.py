"""Checkpoint directories: exact save/load round trips, sharding, and clear errors for bad files."""
import json

import numpy as np
import pytest
from helpers import make_tiny_checkpoint
from safetensors import safe_open
from safetensors.numpy import save_file

from cuinfer.convert import load_preset, random_tensors
from cuinfer.io.checkpoint import expected_tensors, load_checkpoint, save_checkpoint
from cuinfer.ops import runtime
from cuinfer.ops.runtime import CuinferError


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_random_checkpoint_round_trips_exactly(tmp_path, preset, dtype):
    path = make_tiny_checkpoint(tmp_path, preset, dtype, seed=3)
    config, tensors = load_checkpoint(path)
    assert config == load_preset(preset).replace(torch_dtype=dtype)
    ref = random_tensors(config, dtype, seed=3)
    assert list(tensors) == list(ref) == list(expected_tensors(config))
    for name in ref:
        assert same_bits(tensors[name], ref[name]), name
    assert ("lm_head.weight" in tensors) != config.tie_word_embeddings
    assert ("model.layers.1.self_attn.k_proj.bias" in tensors) == config.attention_bias


def test_expected_names_are_the_hugging_face_names():
    names = expected_tensors(load_preset("tiny-qwen2"))
    assert names["model.embed_tokens.weight"] == (49152, 256)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (256, 256)
    assert names["model.layers.1.self_attn.k_proj.weight"] == (64, 256)
    assert names["model.layers.1.self_attn.v_proj.bias"] == (64,)
    assert names["model.layers.0.mlp.down_proj.weight"] == (256, 688)
    assert names["lm_head.weight"] == (49152, 256) and names["model.norm.weight"] == (256,)
    assert len(names) == 1 + 2 * 12 + 2


def test_sharded_save_and_conversion_on_load(tmp_path):
    config = load_preset("tiny")
    ref = random_tensors(config, "bfloat16", seed=1)
    path = save_checkpoint(tmp_path / "sharded", config, ref, dtype="bfloat16", shard_bytes=2**20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (path / "model.safetensors").exists()
    _, loaded = load_checkpoint(path)
    assert all(same_bits(loaded[n], ref[n]) for n in ref)
    _, as32 = load_checkpoint(path, dtype="float32")
    for n in ref:
        assert as32[n].dtype == np.float32 and type(as32[n]) is np.ndarray
        np.testing.assert_array_equal(as32[n], ref[n].astype(np.float32))


def test_files_interoperate_with_safetensors(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "tiny-qwen2", "bfloat16")
    _, ours = load_checkpoint(path)
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        assert set(f.keys()) == set(ours)
        for n in ours:
            assert same_bits(f.get_tensor(n), ours[n]), n
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text((path / "config.json").read_text())
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(32, np.float32)}
    save_file({**{n: np.asarray(a) for n, a in ours.items()}, **extra}, str(theirs / "model.safetensors"))
    _, back = load_checkpoint(theirs)  # a derived buffer (inv_freq) is skipped
    assert all(same_bits(back[n], ours[n]) for n in ours)


def rewrite(path, change):
    """Rewrite model.safetensors of `path` with change(tensors) -> tensors."""
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    save_file(change(tensors), str(path / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    rewrite(path, lambda t: {n: a for n, a in t.items() if n != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(CuinferError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(path)
    rewrite(path, lambda t: {**t, "model.layers.1.mlp.up_proj.weight": np.zeros((688, 256), np.float16),
                             "model.layers.7.mlp.gate_proj.weight": np.zeros(3, np.float16)})
    with pytest.raises(CuinferError, match=r"model\.safetensors: unexpected tensor model\.layers\.7\.mlp"):
        load_checkpoint(path)
    rewrite(path, lambda t: {**{n: a for n, a in t.items() if "layers.7" not in n},
                             "model.norm.weight": np.ones(255, np.float16)})
    with pytest.raises(CuinferError, match=r"tensor model\.norm\.weight has shape \(255,\).*needs \(256,\)"):
        load_checkpoint(path)


def test_truncated_file_names_the_tensor(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CuinferError, match=r"model\.safetensors: truncated: tensor model\.norm\.weight"):
        load_checkpoint(path)
    file.write_bytes(data[:100])
    with pytest.raises(CuinferError, match="truncated safetensors header"):
        load_checkpoint(path)


def test_missing_files(tmp_path):
    with pytest.raises(CuinferError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    path = make_tiny_checkpoint(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CuinferError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(path)
    (path / "config.json").unlink()
    with pytest.raises(CuinferError, match="config.json: no such file"):
        load_checkpoint(path)


def test_missing_shard(tmp_path):
    config = load_preset("tiny")
    path = save_checkpoint(tmp_path / "s", config, random_tensors(config, "float16"), shard_bytes=2**20)
    (path / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(CuinferError, match=r"model-00002-of-00005\.safetensors: no such file"):
        load_checkpoint(path)


def test_save_failures_leave_nothing_behind(tmp_path):
    config = load_preset("tiny")
    tensors = random_tensors(config, "float16")

    class Failing(dict):
        def __getitem__(self, name):
            if name == "model.norm.weight":
                raise RuntimeError("disk on fire")
            return super().__getitem__(name)

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(tmp_path / "out", config, Failing(tensors))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CuinferError, match=r"missing tensor model\.norm\.weight"):
        save_checkpoint(tmp_path / "out", config, {n: a for n, a in tensors.items() if n != "model.norm.weight"})
    with pytest.raises(CuinferError, match=r"tensor model\.norm\.weight: got shape \(3,\)"):
        save_checkpoint(tmp_path / "out", config, {**tensors, "model.norm.weight": np.ones(3)})
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(CuinferError, match="cannot write here"):
        save_checkpoint(tmp_path / "file" / "out", config, tensors)
    save_checkpoint(tmp_path / "out", config, tensors)
    with pytest.raises(CuinferError, match="already exists"):
        save_checkpoint(tmp_path / "out", config, tensors)
    save_checkpoint(tmp_path / "out", config, tensors, dtype=runtime.bfloat16, overwrite=True)
    assert load_checkpoint(tmp_path / "out")[0].torch_dtype == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]
