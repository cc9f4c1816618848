"""AsyncEngine (the server's step loop): its text, stop strings included, equals Engine.generate's,
and the step loop thread never detokenizes."""
import asyncio
import threading

import pytest
from helpers import make_tiny_checkpoint

from cuinfer import Engine, SamplingParams
from cuinfer.serving.async_engine import AsyncEngine, with_text
from cuinfer.serving.detokenizer import RequestText
from cuinfer.serving.engine import RequestOutput

PROMPTS = ["hello there", "numbers like 0123", "the quick brown fox"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async"))


def run_async(engine, prompts, params):
    aengine = AsyncEngine(engine)

    async def one(i, prompt):
        outs = [out async for out in aengine.generate(engine.encode(prompt), params, f"r{i}")]
        return outs

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        return asyncio.run(main())
    finally:
        aengine.shutdown()


def test_text_and_stop_strings_equal_the_engines_and_the_loop_never_detokenizes(ckpt):
    plain = Engine.from_pretrained(ckpt, device="cpu", kv_tokens=4096)
    free = plain.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    # a stop string from the middle of each free-running text: every request stops on one
    stops = tuple(o.text[8:10] for o in free if len(o.text) >= 10)
    assert stops, "the tiny model wrote too little text to pick stop strings from"
    params = SamplingParams(max_new_tokens=24, stop=stops)
    want = plain.generate(PROMPTS, params)
    assert any(o.finish_reason == "stop" for o in want)

    engine = Engine.from_pretrained(ckpt, device="cpu", kv_tokens=4096)
    threads = set()
    decode = engine.tokenizer.decode
    engine.tokenizer.decode = lambda *a, **k: threads.add(threading.current_thread().name) or decode(*a, **k)
    got = run_async(engine, PROMPTS, params)

    assert "cuinfer-step-loop" not in threads and threads
    for outs, w in zip(got, want):
        last = outs[-1]
        assert "".join(o.new_text for o in outs) == last.text == w.text
        assert last.token_ids == w.token_ids and last.finish_reason == w.finish_reason
        assert sum(len(o.new_token_ids) for o in outs) == len(last.token_ids)
    assert engine.scheduler.has_work() is False and engine.kv_cache_usage() == 0.0


class Chars:
    """A tokenizer stand-in whose token i is the character chr(i)."""

    def stream(self):
        return self

    def push(self, token):
        return chr(token)


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
