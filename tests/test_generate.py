"""python -m cuinfer.generate: output, stats line, and exit code 2 with one message on user errors."""
import subprocess
import sys

import pytest
from conftest import HAS_GPU
from helpers import make_tiny_checkpoint

from cuinfer import generate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gen")))


def run(capsys, *argv):
    rc = generate.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_one_prompt_streams_and_prints_stats(ckpt, capsys):
    rc, out, stats = run(capsys, ckpt, "--prompt", "Hello", "--max-new-tokens", "12", "--device", "cpu")
    assert rc == 0 and "[" not in out and stats.startswith("[") and stats.count("\n") == 1  # piped: text only
    assert "prompt tokens" in stats and "TTFT" in stats and "decode" in stats and "% saved" in stats
    assert "12 generated" in stats


def test_several_prompts_file_and_template(ckpt, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\nsecond one\n")
    rc, out, _ = run(capsys, ckpt, "--prompts-file", str(f), "--prompt", "third", "--template",
                     "--system", "Be brief.", "--max-new-tokens", "4", "--device", "cpu",
                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert rc == 0
    assert [l for l in out.splitlines() if l.startswith("--- [")] == [
        f"--- [{i}] (length, 4 tokens)" for i in range(3)]


@pytest.mark.parametrize("flags", [["--speculative", "ngram"], ["--speculative-model", "CKPT"]])
def test_speculative_flags_give_the_same_text_and_report_drafts(ckpt, capsys, flags):
    argv = [ckpt, "--prompt", "one two three one two three one two", "--max-new-tokens", "24", "--device", "cpu"]
    _, plain, _ = run(capsys, *argv)
    rc, out, stats = run(capsys, *argv, *[ckpt if f == "CKPT" else f for f in flags], "--num-speculative-tokens", "3")
    assert rc == 0 and out == plain
    assert "24 generated" in stats and "mean accepted length" in stats
    accepted, proposed = map(int, stats.split(" · drafts ")[1].split(" accepted")[0].split("/"))
    assert 0 < proposed and 0 <= accepted <= proposed
    if flags[0] == "--speculative-model":  # the target as its own draft: every draft accepted
        assert accepted == proposed


@pytest.mark.parametrize("argv, message", [
    (["CKPT", "--prompt", "a", "--device", "cpu", "--speculative-model", "/nonexistent/draft"],
     "no such checkpoint directory"),
    (["/nonexistent/ckpt", "--prompt", "a", "--device", "cpu"], "no such checkpoint directory"),
    (["CKPT", "--device", "cpu"], "nothing to do"),
    (["CKPT", "--prompt", "a " * 3000, "--device", "cpu"], "the context holds 2048"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--dtype", "float16"], "CPU backend runs float32"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--top-p", "0"], "top_p"),
    (["CKPT", "--prompts-file", "/nonexistent/p.txt", "--device", "cpu"], "cannot read prompts"),
    (["CKPT", "--prompts-file", "LATIN1", "--device", "cpu"], "not UTF-8 text (byte 3)"),
    (["CKPT", "--prompt", "ab\udcff", "--device", "cpu"], "prompt: not valid UTF-8 (character 2)"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--seed", "-1"], "seed: got -1, need in [0, 2**63)"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--temperature", "inf"], "temperature: got inf"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--stop", ""], "stop: got ('',), need non-empty strings"),
    (["CKPT", "--prompt", "a", "--device", "cpu", "--kv-tokens", "10000000000"], "GiB of host memory is free"),
])
def test_user_errors_exit_2_with_one_message(ckpt, capsys, tmp_path, argv, message):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    rc, _, err = run(capsys, *[{"CKPT": ckpt, "LATIN1": str(latin1)}.get(a, a) for a in argv])
    assert rc == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_no_gpu(ckpt, capsys):
    rc, _, err = run(capsys, ckpt, "--prompt", "a", "--device", "gpu")
    assert rc == 2 and "no CUDA device" in err


@pytest.mark.parametrize("flags, message", [
    (["--quant", "int3"], "quantization 'int3'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "got '0', need an integer in 1..16"),
    (["--num-speculative-tokens", "four"], "got 'four', need an integer in 1..16"),
])
def test_bad_flag_value_is_an_argparse_error(ckpt, flags, message):
    """Refused while parsing, before any model loads."""
    r = subprocess.run([sys.executable, "-m", "cuinfer.generate", ckpt, "--prompt", "a", *flags],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_default_model_cli(capsys):
    from cuinfer.errors import CuinferError
    from cuinfer.io.default_model import default_model_dir

    try:
        default_model_dir()
    except (CuinferError, ModuleNotFoundError) as e:
        pytest.skip(f"default model not available here: {e}")
    rc, out, err = run(capsys, "--prompt", "The capital of France is", "--max-new-tokens", "16",
                       "--device", "cpu")
    assert rc == 0 and "Paris" in out and "prompt tokens" in err


def test_chat_keeps_history(ckpt):
    r = subprocess.run([sys.executable, "-m", "cuinfer.generate", ckpt, "--chat", "--system", "Be brief.",
                        "--max-new-tokens", "5", "--device", "cpu"], input="hi\n\nand again\n",
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stats = [l for l in r.stderr.splitlines() if "prompt tokens" in l]
    assert len(stats) == 2  # one per turn; the empty line is skipped
    first, second = (int(l.split("[")[1].split()[0]) for l in stats)
    assert second > first + 5  # the second turn's prompt carries the first exchange


@pytest.mark.gpu
def test_no_graphs_flag_gives_the_same_text(ckpt, capsys):
    """--no-graphs runs the GPU decode steps eagerly: same greedy text as the graph replays. The KV cache
    is sized (not 80 % of free memory), as every GPU test's: .ci/gpu runs them in 4 processes at once."""
    texts = []
    for extra in ((), ("--no-graphs",)):
        rc, out, err = run(capsys, ckpt, "--prompt", "Hello", "--max-new-tokens", "40", "--device", "gpu",
                           "--dtype", "float16", "--kv-tokens", "65536", *extra)
        assert rc == 0 and err.startswith("[") and err.count("\n") == 1  # stderr: the stats line alone
        texts.append(out)
    assert texts[0] == texts[1]


def test_a_long_cpu_prefill_says_it_started(ckpt, capsys):
    rc, out, err = run(capsys, ckpt, "--prompt", "word " * 1200, "--max-new-tokens", "2", "--device", "cpu")
    assert rc == 0 and "prefilling" in err and "prompt tokens on the CPU backend" in err
    rc, out, err = run(capsys, ckpt, "--prompt", "short", "--max-new-tokens", "2", "--device", "cpu")
    assert rc == 0 and "prefilling" not in err


@pytest.mark.skipif(HAS_GPU, reason="checks the choice on a machine without a GPU")
def test_eval_picks_the_device_as_generate_does(ckpt, capsys, tmp_path):
    from cuinfer import eval as cuinfer_eval

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    assert cuinfer_eval.main(["perplexity", ckpt, "--text", str(text), "--window", "32", "--stride", "16"]) == 0
    assert "device cpu" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-3"], "argument --max-tokens: got '-3', need an integer >= 2"),
    (["--window", "0"], "argument --window: got '0', need an integer >= 2"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--device", "cpu", "--dtype", "float16"], "error: --dtype float16: the CPU backend runs float32"),
])
def test_eval_refuses_bad_flags(ckpt, tmp_path, flags, message):
    """eval's counts and dtype: one message, exit 2 (--max-tokens -3 used to score all but 3 tokens)."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox.")
    r = subprocess.run([sys.executable, "-m", "cuinfer.eval", "perplexity", ckpt, "--text", str(text), *flags],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(HAS_GPU, reason="checks the choice on a machine without a GPU")
def test_from_pretrained_picks_the_device_as_the_cli_does(ckpt):
    from cuinfer import Engine, SamplingParams

    eng = Engine.from_pretrained(ckpt)
    assert eng.model.xp.__name__ == "numpy"
    assert len(eng.generate("Hello", SamplingParams(max_new_tokens=3))[0].token_ids) == 3
