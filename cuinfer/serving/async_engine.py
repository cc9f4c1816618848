"""The engine in a process of its own, fed from asyncio code (the HTTP server).

    aengine = AsyncEngine.start(path, device="gpu", max_num_seqs=256)  # Engine.from_pretrained's arguments
    async for out in aengine.generate(prompt_ids, params, request_id):
        ...                                  # RequestOutput per step; the last has finish_reason
    aengine.shutdown()                       # running requests end with EngineStopped

The engine's step loop runs in a child process (spawned: it alone touches the GPU), so the
server's Python (HTTP, JSON, detokenization) never holds a lock the step loop needs: in one process
the two shared the GIL, and the steps slowed by a third under 256 streaming clients. Requests and
aborts go to the child over a pipe, drained between steps (blocking when idle). Each step comes
back as one message of the requests' new tokens; a reader thread here hands it to the event loops
with one call_soon_threadsafe each, and each request's coroutine makes its RequestOutput: the
tokens so far, and the text (RequestText: incremental detokenization, stop strings). A stop string
ends the stream at the token that completed it and aborts the request in the engine. A caller that
stops iterating (a client that disconnects) aborts its request, which frees its KV blocks at the
loop's next turn.
"""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import signal
import threading

from ..errors import CuinferError
from .detokenizer import RequestText
from .request import RequestOutput


class EngineStopped(CuinferError):
    pass


class AsyncEngine:
    def __init__(self, conn, process, tokenizer, info: dict):
        """Use start(); conn: this end of the pipe to the engine process, info: its "ready" message."""
        self.tokenizer, self.max_len = tokenizer, info["max_len"]
        self.warm_up = info["warm_up"]  # Engine.warm_up's report
        self._conn, self._process = conn, process
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _streams and _stats (event loops and the reader thread)
        self._streams = {}  # request id -> (event loop, asyncio.Queue)
        self._stats = info["stats"]
        self._stopped = False
        self._reader = threading.Thread(target=self._read, name="cuinfer-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, path, **engine_args) -> AsyncEngine:
        """Spawn the engine process for checkpoint directory `path` (Engine.from_pretrained's
        arguments) and wait until it is loaded; its CuinferError (a bad checkpoint, too little
        memory) is raised here."""
        from ..io.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(path)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
        conn, child = ctx.Pipe()
        process = ctx.Process(target=_engine_main, args=(child, str(path), engine_args), name="cuinfer-engine",
                              daemon=True)
        process.start()
        child.close()
        try:
            kind, payload = conn.recv()
        except EOFError:
            process.join()
            raise CuinferError(f"the engine process exited while loading (exit code {process.exitcode})") from None
        if kind != "ready":
            process.join()
            raise CuinferError(payload)
        return cls(conn, process, tokenizer, payload)

    async def generate(self, prompt_ids, params, request_id: str):
        """Yield the request's RequestOutputs; raises the engine's CuinferError if it refuses it."""
        if self._stopped:
            raise EngineStopped("the engine is shutting down")
        out_queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        prompt_ids = list(prompt_ids)
        self._send(("add", request_id, prompt_ids, params))
        text = RequestText(self.tokenizer, params.stop)
        token_ids = []
        engine_done = False  # the engine has finished the request (else it must be aborted)
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    engine_done = True
                    raise item
                new_ids, new_logprobs, reason, cached, ttft, prompt_logprobs = item
                token_ids += new_ids
                engine_done = reason is not None
                out = with_text(RequestOutput(request_id, prompt_ids, list(token_ids), "", "", new_ids, reason,
                                              cached, ttft, new_logprobs, prompt_logprobs), text)
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not engine_done:
                self._send(("abort", request_id))

    def alive(self) -> bool:
        """Whether the engine process is running and taking requests."""
        return not self._stopped and self._process.is_alive()

    def stats(self) -> dict:
        """running, waiting, kv_cache_usage, draft_tokens, accepted_tokens as of the engine's last step."""
        with self._lock:
            return dict(self._stats)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process; running requests end with EngineStopped."""
        if not self._stopped:
            self._send(("stop",))
        self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    def _send(self, msg):
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the engine process has gone: the reader thread fails the streams

    # ------------------------------------------------------------------ reader thread

    def _read(self):
        error = EngineStopped("the server is shutting down")
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                error = CuinferError("the engine process exited")
                break
            if msg[0] == "step":
                _, items, stats = msg
                with self._lock:
                    self._stats = stats
                    targets = [(self._streams.get(rid), item) for rid, item in items]
                self._deliver([(t, item) for t, item in targets if t is not None])
            elif msg[0] == "error":  # one request refused, or every running one failed
                _, rids, message = msg
                with self._lock:
                    targets = [(self._streams.get(rid), CuinferError(message)) for rid in rids]
                self._deliver([(t, e) for t, e in targets if t is not None])
            elif msg[0] == "stopped":
                break
        self._stopped = True
        with self._lock:
            targets = list(self._streams.values())
        self._deliver([(t, error) for t in targets])

    @staticmethod
    def _deliver(pairs):
        """Items to their queues, one call_soon_threadsafe per event loop."""
        by_loop = {}
        for (loop, out_queue), item in pairs:
            by_loop.setdefault(loop, []).append((out_queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop has closed: nobody is listening
                pass


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


# ---------------------------------------------------------------------- the engine process

def _engine_main(conn, path: str, engine_args: dict):
    """The child: load the engine, say "ready", then step while there is work, draining the pipe
    between steps. Messages in: ("add", id, prompt ids, params), ("abort", id), ("stop",); out:
    ("ready", info) or ("error", message) once, then ("step", [(id, (new ids, new logprobs,
    finish reason, cached tokens, ttft, prompt logprobs))], stats) per step, ("error", ids, message) for refused or
    failed requests, and ("stopped",) last."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C reaches the whole group: it stops us
    from .engine import Engine

    try:
        engine = Engine.from_pretrained(path, **engine_args)
        warm = engine.warm_up()
    except (CuinferError, ValueError) as e:
        conn.send(("error", str(e)))
        return
    engine.detokenize = False  # the server makes the text, in its own process
    conn.send(("ready", {"max_len": engine.max_len, "stats": _stats(engine), "warm_up": warm}))
    live = set()
    while True:
        drained = False  # block for the first message when idle, then take what is there
        try:
            while conn.poll(0 if drained or engine.has_unfinished_requests() else None):
                drained = True
                msg = conn.recv()
                if msg[0] == "stop":
                    conn.send(("stopped",))
                    return
                if msg[0] == "abort":
                    live.discard(msg[1])
                    engine.abort_request(msg[1])
                    continue
                _, rid, prompt_ids, params = msg
                try:
                    engine.add_request(prompt_ids, params, request_id=rid)
                    live.add(rid)
                except Exception as e:  # a refused request ends alone; the engine goes on
                    conn.send(("error", [rid], str(e) if isinstance(e, CuinferError) else f"request refused: {e!r}"))
        except (EOFError, OSError):  # the server has gone
            return
        if not engine.has_unfinished_requests():
            if drained:  # aborts may have emptied the batch: say so
                conn.send(("step", [], _stats(engine)))
            continue
        try:
            outs = engine.step()
        except Exception as e:  # an engine failure ends every request with its message
            for rid in live:
                engine.abort_request(rid)
            message = str(e) if isinstance(e, CuinferError) else f"engine step failed: {e!r}"
            conn.send(("error", sorted(live), message))
            live.clear()
            continue
        items = []
        for o in outs:
            items.append((o.request_id, (o.new_token_ids, o.new_logprobs, o.finish_reason, o.num_cached_tokens,
                                         o.ttft_s, o.prompt_logprobs)))
            if o.finished:
                live.discard(o.request_id)
        conn.send(("step", items, _stats(engine)))


def _stats(engine) -> dict:
    return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
            "kv_cache_usage": engine.kv_cache_usage(), "draft_tokens": engine.stats.draft_tokens,
            "accepted_tokens": engine.stats.accepted_tokens}
