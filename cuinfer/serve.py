"""An OpenAI-compatible server: python -m cuinfer.serve [CKPT] [--host 127.0.0.1] [--port 8000] ...

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
stream=true), GET /v1/models, /health, /metrics (Prometheus). The engine steps in its own
process (serving.async_engine); this one validates, tokenizes, detokenizes and writes JSON.
Bad requests get OpenAI's error body with a 4xx status, and never reach the engine.
Needs the serve extra: pip install -e '.[serve]'.
"""

import argparse
import asyncio
import socket
import sys
import time
import uuid

from .cli import add_kv_cache_dtype_argument, add_speculative_arguments, check_dtype, int_in, speculative_options
from .errors import CuinferError
from .ops import runtime
from .serving.sampling import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def sampling_params(req, prompt_len: int, max_len: int, index: int) -> SamplingParams:
    try:
        logprobs = req.num_logprobs
    except ValueError as e:
        raise APIError(400, str(e), param="top_logprobs") from None
    limit = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if prompt_len >= max_len:
        raise APIError(400, f"prompt: {prompt_len} tokens, the context holds {max_len} (room for at least one "
                            f"new token needed)", param="messages" if hasattr(req, "messages") else "prompt",
                       code="context_length_exceeded")
    if limit is not None and prompt_len + limit > max_len:
        raise APIError(400, f"max_tokens: {limit} past the context: the prompt has {prompt_len} tokens and the "
                            f"context holds {max_len}", param="max_tokens", code="context_length_exceeded")
    seed = None if req.seed is None else (req.seed + index) % 2 ** 63
    return SamplingParams(max_new_tokens=limit or max_len - prompt_len, temperature=req.temperature,
                          top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                          repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, logprobs=logprobs, seed=seed, stop=req.stops,
                          ignore_eos=req.ignore_eos, prompt_logprobs=logprobs if getattr(req, "echo", False) else None)


def build_app(aengine, model_name: str, api_key: str | None = None, max_waiting: int = 1024):
    """aengine: a started AsyncEngine; max_waiting: requests queued for admission past which new
    ones get 503 and Retry-After."""
    import orjson
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import generate_latest

    from .serving.metrics import Metrics
    from .serving.openai_protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        chat_logprobs,
        completion_logprobs,
    )
    from .serving.request import encode_prompt

    metrics = Metrics(aengine)
    app = FastAPI(title="cuinfer", on_shutdown=[aengine.shutdown])
    app.state.aengine = aengine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error')})")
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        msg = str(err.get("msg")).removeprefix("Value error, ")
        return error_response(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(APIError)
    async def _api_error(request, exc):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                      "authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not aengine.alive():
            raise APIError(503, "the engine process has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "cuinfer"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    def check_model(req):
        if req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist: this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def encode(prompt) -> list:
        try:
            return encode_prompt(aengine.tokenizer, prompt)
        except CuinferError as e:
            raise APIError(400, str(e), param="prompt") from None

    def run(ids_list, req):
        """The choices of a request: one engine request per prompt and per n."""
        if aengine.stats()["waiting"] >= max_waiting:
            raise APIError(503, f"the server is at capacity ({max_waiting} requests waiting): retry shortly",
                           "server_overloaded", headers={"Retry-After": "1"})
        base = uuid.uuid4().hex
        jobs = []
        for p, ids in enumerate(ids_list):
            for k in range(req.n):
                index = p * req.n + k
                try:
                    params = sampling_params(req, len(ids), aengine.max_len, k)
                except CuinferError as e:
                    raise APIError(400, str(e)) from None
                jobs.append((index, ids, params, f"{base}-{index}"))
        return base, jobs

    async def observed(ids, params, rid):
        """The request's RequestOutputs; its metrics are recorded when it finishes."""
        started = time.perf_counter()
        async for out in aengine.generate(ids, params, rid):
            if out.finished:
                metrics.finished(out, started)
            yield out

    async def merged(jobs):
        """(choice index, RequestOutput) from every job as they come."""
        if len(jobs) == 1:  # the common case: no task and queue in between
            index, *job = jobs[0]
            async for out in observed(*job):
                yield index, out
            return
        q = asyncio.Queue()

        async def pump(index, ids, params, rid):
            try:
                async for out in observed(ids, params, rid):
                    await q.put((index, out))
            except CuinferError as e:
                await q.put((index, e))

        tasks = [asyncio.create_task(pump(*job)) for job in jobs]
        done = 0
        try:
            while done < len(jobs):
                index, item = await q.get()
                if isinstance(item, CuinferError):
                    raise item
                done += item.finished
                yield index, item
        finally:
            for t in tasks:
                t.cancel()

    def usage(finals):
        first = {}
        for out in finals.values():
            first.setdefault(tuple(out.prompt_ids), out)
        prompt = sum(len(o.prompt_ids) for o in first.values())
        completion = sum(len(o.token_ids) for o in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in first.values())}}

    async def respond(req, ids_list, chat: bool):
        base, jobs = run(ids_list, req)
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        # echo (completions): each choice's text starts with its prompt, as the tokenizer decodes it
        echoed = {i: aengine.tokenizer.decode(ids) for i, ids, *_ in jobs} if getattr(req, "echo", False) else {}
        if not req.stream:
            texts, finals, lps = dict(echoed), {}, {}
            try:
                async for i, out in merged(jobs):
                    texts[i] = texts.get(i, "") + out.new_text
                    lps.setdefault(i, []).extend((out.prompt_logprobs or []) + out.new_logprobs)
                    if out.finished:
                        finals[i] = out
            except CuinferError as e:
                raise APIError(503 if "shutting down" in str(e) else 400, str(e)) from None
            to_logprobs = chat_logprobs if chat else completion_logprobs
            choices = [{"index": i, "finish_reason": finals[i].finish_reason,
                        **({"message": {"role": "assistant", "content": texts[i]}} if chat
                           else {"text": texts[i]}),
                        "logprobs": to_logprobs(aengine.tokenizer, (finals[i].prompt_ids if echoed else [])
                                                + finals[i].token_ids, lps[i])}
                       for i in sorted(finals)]
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": choices, "usage": usage(finals)})

        def chunk(choices, extra=None):
            body = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": model_name, "choices": choices, **(extra or {})}
            return b"data: " + orjson.dumps(body) + b"\n\n"

        async def events():
            finals = {}
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for i, *_ in jobs])
            try:
                async for i, out in merged(jobs):
                    if i in echoed:  # the prompt first, with its logprobs (they come with the first output)
                        lp = completion_logprobs(aengine.tokenizer, out.prompt_ids, out.prompt_logprobs)
                        yield chunk([{"index": i, "text": echoed.pop(i), "finish_reason": None, "logprobs": lp}])
                    if out.finished:
                        finals[i] = out
                    if out.new_token_ids or out.finished:  # one chunk a token (its text may be held back)
                        piece = {"content": out.new_text} if chat else None
                        lp = (chat_logprobs if chat else completion_logprobs)(
                            aengine.tokenizer, out.new_token_ids, out.new_logprobs)
                        yield chunk([{"index": i, **({"delta": piece} if chat else {"text": out.new_text}),
                                      "finish_reason": out.finish_reason, "logprobs": lp}])
            except CuinferError as e:
                yield b"data: " + orjson.dumps({"error": {"message": str(e), "type": "server_error",
                                                          "param": None, "code": None}}) + b"\n\n"
                return
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], {"usage": usage(finals)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = aengine.tokenizer.encode_chat(messages)
        except (ValueError, CuinferError) as e:  # a non-text content part, a template that fails
            raise APIError(400, str(e), param="messages") from None
        return await respond(req, [ids], chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req)
        return await respond(req, [encode(p) for p in req.prompts()], chat=False)

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuinfer.serve", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory or GGUF file (default: the default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="0: any free port")
    p.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu when one is found")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), help="GPU dtype (default from the checkpoint)")
    p.add_argument("--quant", metavar="SPEC", help="quantize the linear weights at load (as generate's --quant)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1/ endpoints")
    p.add_argument("--max-num-seqs", type=int_in(1), default=256)
    p.add_argument("--max-batch-tokens", type=int_in(1), default=2048, help="tokens of one step (chunked prefill)")
    p.add_argument("--max-waiting", type=int_in(1), default=1024,
                   help="requests waiting for admission past which new ones get 503 with Retry-After")
    p.add_argument("--kv-tokens", type=int_in(1), help="KV cache size in tokens (default: GPU memory / 16k on CPU)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint's folder name)")
    add_kv_cache_dtype_argument(p)
    add_speculative_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs its extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    try:
        from .io.checkpoint import resolve_checkpoint
        from .serving.async_engine import AsyncEngine

        check_listen(args.host, args.port)
        path = resolve_checkpoint(args.checkpoint)
        device = runtime.pick_device(args.device)
        check_dtype(device, args.dtype)
        aengine = AsyncEngine.start(path, device=device, dtype=args.dtype, quant=args.quant,
                                    kv_tokens=args.kv_tokens, kv_cache_dtype=args.kv_cache_dtype,
                                    max_batch_tokens=args.max_batch_tokens,
                                    max_num_seqs=args.max_num_seqs, **speculative_options(args))
    except (CuinferError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or path.name
    app = build_app(aengine, name, args.api_key, args.max_waiting)
    warm = aengine.warm_up
    print(f"cuinfer serving {name} on {device} at http://{args.host}:{args.port}/v1 (warm-up "
          f"{warm['seconds']:.1f} s, {warm['graphs']} graphs, {warm['graph_mib']:.0f} MiB)",
          file=sys.stderr, flush=True)
    server = _server_class()(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    server.aengine = app.state.aengine
    server.run()
    return 0


def check_listen(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (a port in use, an unknown host) before the
    model loads, binding as uvicorn binds (SO_REUSEADDR); the socket is closed again."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise CuinferError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise CuinferError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGINT/SIGTERM first stops the engine: running requests end at
        once with an error event, so the graceful shutdown that waits for them does not hang."""

        def handle_exit(self, sig, frame):
            self.aengine.shutdown()
            super().handle_exit(sig, frame)

    return Server


if __name__ == "__main__":
    sys.exit(main())
