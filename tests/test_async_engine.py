"""AsyncEngine (the server's engine process): its text, stop strings included, equals
Engine.generate's; a stop string aborts the request in the engine; cut steps keep their tokens
straight."""
import asyncio

import numpy as np
import pytest
from helpers import make_tiny_checkpoint

from cuinfer import Engine, SamplingParams
from cuinfer.serving.async_engine import AsyncEngine, with_text
from cuinfer.serving.detokenizer import RequestText
from cuinfer.serving.request import RequestOutput

PROMPTS = ["hello there", "numbers like 0123", "the quick brown fox"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async"))


def run_async(aengine, prompts, params):
    async def one(i, prompt):
        return [out async for out in aengine.generate(aengine.tokenizer.encode(prompt), params, f"r{i}")]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def test_text_and_stop_strings_equal_the_engines(ckpt):
    plain = Engine.from_pretrained(ckpt, device="cpu", kv_tokens=4096)
    free = plain.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    # a stop string from the middle of each free-running text: every request stops on one
    stops = tuple(o.text[8:10] for o in free if len(o.text) >= 10)
    assert stops, "the tiny model wrote too little text to pick stop strings from"
    params = SamplingParams(max_new_tokens=24, stop=stops)
    want = plain.generate(PROMPTS, params)
    assert any(o.finish_reason == "stop" for o in want)

    aengine = AsyncEngine.start(ckpt, device="cpu", kv_tokens=4096)
    try:
        got = run_async(aengine, PROMPTS, params)
        for outs, w in zip(got, want):
            last = outs[-1]
            assert "".join(o.new_text for o in outs) == last.text == w.text
            assert last.token_ids == w.token_ids and last.finish_reason == w.finish_reason
            assert sum(len(o.new_token_ids) for o in outs) == len(last.token_ids)
        stats = aengine.stats()
        for _ in range(100):  # the aborts of the stopped requests reach the engine process
            if stats["running"] == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
            stats = aengine.stats()
        assert stats == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "draft_tokens": 0, "accepted_tokens": 0}
    finally:
        aengine.shutdown()


def test_a_dead_engine_process_ends_streams_with_an_error(ckpt):
    from cuinfer.errors import CuinferError

    aengine = AsyncEngine.start(ckpt, device="cpu", kv_tokens=4096)

    async def stream():
        return [out async for out in aengine.generate([5, 6, 7], SamplingParams(max_new_tokens=10_000,
                                                                               ignore_eos=True), "r")]

    async def main():
        task = asyncio.create_task(stream())
        await asyncio.sleep(0.5)  # the request is running
        aengine._process.kill()
        with pytest.raises(CuinferError, match="engine process exited"):
            await asyncio.wait_for(task, 30)

    try:
        assert aengine.alive()
        asyncio.run(main())
        assert not aengine.alive()
    finally:
        aengine.shutdown()


def test_a_bad_checkpoint_fails_start_with_its_message(tmp_path):
    from cuinfer.errors import CuinferError

    ckpt = make_tiny_checkpoint(tmp_path)
    (ckpt / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(CuinferError, match="NoSuchForCausalLM|architecture"):
        AsyncEngine.start(ckpt, device="cpu")


class Chars:
    """A tokenizer stand-in whose token i is the character chr(i)."""

    def stream(self):
        return self

    def push(self, token):
        return chr(token)


def test_request_text_finds_stop_strings_as_a_whole_text_search_does():
    """RequestText searches only the tail a stop string can start in: against a search of the whole
    text after every push, on random pieces of 1-3 characters over a small alphabet (stops spanning
    pushes, overlapping stops, a stop inside one piece)."""
    rng = np.random.default_rng(7)
    pieces = ["a", "b", "c", "ab", "ba", "cab", "bc", "aa"]

    class Pieces:
        def stream(self):
            return self

        def push(self, token):
            return pieces[token]

    for _ in range(300):
        stops = tuple("".join(rng.choice(list("abc"), rng.integers(1, 5))) for _ in range(rng.integers(1, 3)))
        text, whole = RequestText(Pieces(), stop=stops), ""
        for token in rng.integers(0, len(pieces), 30):
            whole += pieces[token]
            cut = min((i for i in (whole.find(s) for s in stops) if i >= 0), default=-1)
            assert text.push(int(token)) == (cut >= 0)
            if cut >= 0:
                assert text.text == whole[:cut]
                break
            assert text.text == whole


def test_with_text_cuts_a_step_of_several_tokens_at_its_stop_string():
    text = RequestText(Chars(), stop=("cd",))
    out = RequestOutput("r", [1], [ord(c) for c in "abcde"], "", new_token_ids=[ord(c) for c in "abcde"],
                        new_logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0])
    cut = with_text(out, text)
    assert cut.finish_reason == "stop" and cut.text == cut.new_text == "ab"
    assert cut.token_ids == cut.new_token_ids == [ord(c) for c in "abcd"]
    assert cut.new_logprobs == [-1.0, -2.0, -3.0, -4.0]


def test_with_text_holds_back_a_possible_stop_and_keeps_an_end_token_out_of_the_text():
    text = RequestText(Chars(), stop=("xyz",))
    first = with_text(RequestOutput("r", [1], [ord("a"), ord("x")], "", new_token_ids=[ord("a"), ord("x")]), text)
    assert first.new_text == "" and not first.finished  # "ax" may still become "axyz": two held back
    end = with_text(RequestOutput("r", [1], [ord("a"), ord("x"), 0], "", new_token_ids=[0], finish_reason="stop"),
                    text)
    assert end.new_text == "ax" and end.text == "ax" and end.finish_reason == "stop"
