"""OpenAI request bodies as pydantic models: what the server accepts, validated before the engine
sees it. Fields the engine cannot honour yet are refused by name (never silently ignored). Also the
response pieces built from engine outputs (logprobs objects)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NOT_SUPPORTED = {"best_of": None, "suffix": None, "tools": None, "response_format": None}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields both endpoints share."""
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    logprobs: bool | int | None = False  # chat: a bool (with top_logprobs); completions: how many alternatives
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _supported(self):
        for name, default in NOT_SUPPORTED.items():
            value = getattr(self, name, default)
            if value not in (default, None):
                raise ValueError(f"{name}: not supported by cuinfer yet (got {value!r})")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop: at most 16 strings")
        if not isinstance(self.logprobs, bool) and self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: got {self.logprobs}, need 0 to 20")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise ValueError("stop: strings must be non-empty")
        return self

    @property
    def stops(self) -> tuple:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}]
            parts = [p.get("text") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or not all(isinstance(t, str) for t in parts):
                raise ValueError("messages: only text content parts are supported")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo: a completions field, not supported for chat completions")
        return self

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)

    @property
    def num_logprobs(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# ------------------------------------------------------------------ response pieces

def chat_logprobs(tokenizer, token_ids, entries) -> dict | None:
    """OpenAI's chat `logprobs` object for these tokens (None when not asked)."""
    if not entries:
        return None

    def one(t, lp):
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, v) for a, v in top]}
                        for t, (lp, top) in zip(token_ids, entries)]}


def completion_logprobs(tokenizer, token_ids, entries, offset: int = 0) -> dict | None:
    """The completions endpoint's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset);
    an entry None (an echoed prompt's first token, which nothing predicts) gives None there."""
    if not entries:
        return None
    texts = [tokenizer.decode([t]) for t in token_ids]
    offsets = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else {tokenizer.decode([a]): v for a, v in e[1]} for e in entries],
            "text_offset": offsets}
