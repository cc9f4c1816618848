"""The engine's step loop in its own thread, fed from asyncio code (the HTTP server).

    aengine = AsyncEngine(engine)            # starts the loop thread
    async for out in aengine.generate(prompt_ids, params, request_id):
        ...                                  # RequestOutput per step; the last has finish_reason
    aengine.shutdown()                       # running requests end with EngineStopped

Requests and aborts cross into the loop through one thread-safe queue; the loop drains it
between steps (blocking on it when idle), so the engine is only ever touched by its own thread.
Each request's outputs come back through its own asyncio.Queue, a step's outputs with one
loop.call_soon_threadsafe per event loop. The loop never detokenizes (engine.detokenize is turned off): each
caller makes its request's text from the tokens (RequestText) and, when a stop string completes,
ends its stream there and aborts the request. A caller that stops iterating (a client that disconnects) aborts its
request, which frees its KV blocks at the loop's next turn.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading

from ..errors import CuinferError
from .detokenizer import RequestText


class EngineStopped(CuinferError):
    pass


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
        engine.detokenize = False  # generate() makes the text, off the step loop
        self._inbox = queue.SimpleQueue()
        self._streams = {}  # request id -> (event loop, asyncio.Queue); loop thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="cuinfer-step-loop", daemon=True)
        self._thread.start()

    async def generate(self, prompt, params, request_id: str):
        """Yield the request's RequestOutputs; raises the engine's CuinferError if it refuses it."""
        if self._stopped:
            raise EngineStopped("the engine is shutting down")
        out_queue = asyncio.Queue()
        text = RequestText(self.engine.tokenizer, params.stop)
        self._inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), out_queue))
        engine_done = False  # the engine has finished the request (else it must be aborted)
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                engine_done = item.finished
                out = with_text(item, text)
                yield out
                if out.finished:
                    return
        finally:
            if not engine_done:
                self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        """Numbers for /metrics, read without locking (each is one attribute read)."""
        sched = self.engine.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "kv_cache_usage": self.engine.kv_cache_usage()}

    def shutdown(self, timeout: float = 5.0) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ loop thread

    def _run(self):
        eng = self.engine
        while True:
            if not self._drain(block=not eng.has_unfinished_requests()):
                break
            if not eng.has_unfinished_requests():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # an engine failure ends every request with its message
                self._fail_all(e if isinstance(e, CuinferError) else CuinferError(f"engine step failed: {e!r}"))
                continue
            self._deliver_step(outs)
        self._stopped = True
        self._fail_all(EngineStopped("the server is shutting down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg[0] == "stop":
                return False
            if msg[0] == "abort":
                self._streams.pop(msg[1], None)
                self.engine.abort_request(msg[1])
                continue
            _, rid, prompt, params, loop, out_queue = msg
            self._streams[rid] = (loop, out_queue)
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except CuinferError as e:
                self._deliver(rid, e, True)

    def _deliver_step(self, outs):
        """A step's outputs to their queues: one call_soon_threadsafe per event loop (one wake-up of
        it, not one per token)."""
        by_loop = {}
        for out in outs:
            target = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop has closed: nobody is listening
                for _, out in items:
                    self.engine.abort_request(out.request_id)

    def _deliver(self, rid, item, last: bool):
        target = self._streams.pop(rid, None) if last else self._streams.get(rid)
        if target is not None:
            loop, out_queue = target
            try:
                loop.call_soon_threadsafe(out_queue.put_nowait, item)
            except RuntimeError:  # its event loop has closed: nobody is listening
                self.engine.abort_request(rid)

    def _fail_all(self, error):
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._deliver(rid, error, True)


def _put_all(items):
    for out_queue, item in items:
        out_queue.put_nowait(item)


def with_text(out, text: RequestText):
    """The engine's output `out` (made without text) with its text from `text`; at a completed stop
    string it ends there: finished "stop", without the tokens after the one that completed it."""
    ids = out.new_token_ids[:-1] if out.finish_reason == "stop" else out.new_token_ids  # an end token has no text
    for j, token in enumerate(ids):
        if text.push(token):
            extra = len(out.new_token_ids) - j - 1
            return dataclasses.replace(
                out, token_ids=out.token_ids[:len(out.token_ids) - extra], new_token_ids=out.new_token_ids[:j + 1],
                new_logprobs=out.new_logprobs[:j + 1], finish_reason="stop", new_text=text.take(final=True),
                text=text.taken)
    new = text.take(final=out.finished)
    return dataclasses.replace(out, new_text=new, text=text.taken)
