"""The engine's step loop in its own thread, fed from asyncio code (the HTTP server).

    aengine = AsyncEngine(engine)            # starts the loop thread
    async for out in aengine.generate(prompt_ids, params, request_id):
        ...                                  # RequestOutput per step; the last has finish_reason
    aengine.shutdown()                       # running requests end with EngineStopped

Requests and aborts cross into the loop through one thread-safe queue; the loop drains it
between steps (blocking on it when idle), so the engine is only ever touched by its own thread.
Each request's outputs come back through its own asyncio.Queue, filled with
loop.call_soon_threadsafe. A caller that stops iterating (a client that disconnects) aborts its
request, which frees its KV blocks at the loop's next turn.
"""
from __future__ import annotations

import asyncio
import queue
import threading

from ..errors import CuinferError


class EngineStopped(CuinferError):
    pass


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
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
        self._inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), out_queue))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        """Numbers for /metrics, read without locking (each is one attribute read)."""
        sched, st = self.engine.scheduler, self.engine.stats
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "kv_cache_usage": self.engine.kv_cache_usage(),
                "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens}

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
            for out in outs:
                self._deliver(out.request_id, out, out.finished)
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
