"""Generate text: python -m cuinfer.generate [CKPT] --prompt "..." [--chat] [sampling flags].

Without CKPT the default model (SmolLM2-135M-Instruct, converted once into the cache) is
used. One prompt streams as it is generated; several run as one continuous batch and print
in order. --chat opens an interactive conversation with the model's chat template. A final
line on stderr (piped output is only the text) gives prompt tokens, time to first token, prefill
and decode speed, with speculative decoding the draft tokens accepted of those proposed and the
mean accepted length (tokens a sequence gains per verify step), and the KV memory the paged cache
held against a contiguous cache of the full context per sequence.
User errors end with one message and exit code 2, after whatever was already printed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .cli import (
    add_kv_cache_dtype_argument,
    add_speculative_arguments,
    check_dtype,
    int_in,
    quant_spec,
    speculative_options,
)
from .ops import runtime
from .serving.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuinfer.generate", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?",
                   help="checkpoint directory or GGUF file (converted once); default: the default model")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--template", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--chat", action="store_true", help="interactive chat with history")
    p.add_argument("--system", help="system message for --chat and --template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, help="sampling seed (reproducible per prompt)")
    p.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu when one is found")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="GPU: float16 or bfloat16 (default from the checkpoint); CPU: float32")
    p.add_argument("--quant", type=quant_spec, metavar="SPEC",
                   help="quantize the linear weights at load: int8, int4 (group 128), int4-g32, int4-g64-mse, ... "
                        "(the lm_head becomes int8); a checkpoint saved quantized (python -m cuinfer.quantize) "
                        "loads without it")
    p.add_argument("--no-graphs", action="store_true",
                   help="GPU: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--kv-tokens", type=int_in(1), help="KV cache size in tokens (default: GPU memory / 16k on CPU)")
    add_kv_cache_dtype_argument(p)
    add_speculative_arguments(p)
    return p


def read_prompts(args) -> list:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as e:
            raise runtime.CuinferError(f"{args.prompts_file}: cannot read prompts ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise runtime.CuinferError(f"{args.prompts_file}: not UTF-8 text (byte {e.start})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts and not args.chat:
        raise runtime.CuinferError("nothing to do: give --prompt, --prompts-file or --chat")
    return prompts


def messages(system, turns) -> list:
    return ([{"role": "system", "content": system}] if system else []) + turns


def stats_line(engine) -> str:
    s = engine.stats
    rate = lambda n, t: f"{n / t:.1f}" if t > 0 else "-"
    kv = s.kv
    mib = lambda b: f"{b / 2 ** 20:.1f} MiB"
    kv_text = (f"KV {mib(kv['paged_bytes'])} paged vs {mib(kv['contiguous_bytes'])} contiguous "
               f"({100 * kv['saving']:.1f}% saved)") if kv else "KV -"
    spec = (f" · drafts {s.accepted_tokens}/{s.draft_tokens} accepted, mean accepted length "
            f"{s.mean_accepted_length:.2f}") if engine.spec is not None else ""
    return (f"[{s.prompt_tokens} prompt tokens · TTFT {1000 * s.ttft_s:.0f} ms · prefill "
            f"{rate(s.prefill_tokens, s.prefill_s)} tok/s · decode {rate(s.decode_tokens, s.decode_s)} tok/s "
            f"· {s.generated_tokens} generated{spec} · {kv_text}]")


CPU_QUIET_TOKENS = 1024  # a CPU prefill longer than this (seconds) says it has started


def run_prompts(engine, prompts, params, out):
    if engine.model.xp is np:
        prompts = [engine.encode(p) for p in prompts]  # token ids: the engine does not encode them again
        lens = [len(p) for p in prompts]
        n = sum(lens)
        if n > CPU_QUIET_TOKENS and max(lens) < engine.max_len:  # (a prompt too long is refused at once)
            print(f"prefilling {n} prompt tokens on the CPU backend (seconds before the first token)...",
                  file=sys.stderr, flush=True)
    if len(prompts) == 1:
        for _, text in engine.stream(prompts, params):
            out.write(text)
            out.flush()
        out.write("\n")
        return
    for i, o in enumerate(engine.generate(prompts, params)):
        out.write(f"--- [{i}] ({o.finish_reason}, {len(o.token_ids)} tokens)\n{o.text}\n")


def chat(engine, system, params, out):
    turns = []
    while True:
        try:
            user = input("> ")
        except EOFError:
            return
        if not user.strip():
            continue
        turns.append({"role": "user", "content": user})
        ids = engine.tokenizer.encode_chat(messages(system, turns))
        reply = ""
        for _, text in engine.stream([ids], params):
            reply += text
            out.write(text)
            out.flush()
        out.write("\n")
        print(stats_line(engine), file=sys.stderr)
        turns.append({"role": "assistant", "content": reply})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        prompts = read_prompts(args)
        device = runtime.pick_device(args.device)
        check_dtype(device, args.dtype)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                stop=tuple(args.stop))
        from .serving.engine import Engine

        engine = Engine.from_pretrained(args.checkpoint, device=device, dtype=args.dtype,
                                        quant=args.quant, kv_tokens=args.kv_tokens,
                                        kv_cache_dtype=args.kv_cache_dtype,
                                        use_graphs=not args.no_graphs, **speculative_options(args))
        if args.template:
            prompts = [engine.tokenizer.encode_chat(messages(args.system, [{"role": "user", "content": p}]))
                       for p in prompts]
        if prompts:
            run_prompts(engine, prompts, params, out)
            out.flush()
            print(stats_line(engine), file=sys.stderr)
        if args.chat:
            chat(engine, args.system, params, out)
    except runtime.CuinferError as e:
        out.flush()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
