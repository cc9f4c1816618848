"""What a request is to a caller: its prompt as token ids, its outputs step by step, and the
numbers of a run. A leaf of the serving layer (no model, no kernels), so that the server's process,
which only streams outputs, imports none of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CuinferError


class PromptTooLongError(CuinferError):
    pass


def encode_prompt(tokenizer, prompt) -> list:
    """A prompt as token ids: a list of ints is taken as is, a string goes through the tokenizer."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise CuinferError("this engine has no tokenizer: pass prompts as token id lists")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes from a command line arrive as surrogates
            raise CuinferError(f"prompt: not valid UTF-8 (character {e.start})") from None
        return list(tokenizer.encode(prompt))
    return [int(t) for t in prompt]


@dataclass
class RequestOutput:
    """A request after a step: the new text and tokens of this step, and everything so far."""
    request_id: str
    prompt_ids: list
    token_ids: list  # generated so far (the end token included when it stopped on one)
    text: str  # the text so far, less a tail that might still become a stop string
    new_text: str = ""
    new_token_ids: list = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end token or stop string), "length", "abort"
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    ttft_s: float = 0.0  # submission to the first token
    # with SamplingParams.logprobs: per new token (its logprob, [(token, logprob)] of the top ones)
    new_logprobs: list = field(default_factory=list)
    # with SamplingParams.prompt_logprobs, in the first output: per prompt token as new_logprobs
    # (None for the first, which nothing predicts)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache
    generated_tokens: int = 0
    ttft_s: float = 0.0  # first request: submission to its first token
    prefill_s: float = 0.0  # steps that carried prompt tokens
    prefill_tokens: int = 0
    decode_s: float = 0.0  # steps of decodes only (mixed steps count as prefill)
    decode_tokens: int = 0  # tokens sampled in those steps
    preemptions: int = 0
    pipelined_steps: int = 0  # decode steps launched before the previous step's tokens were read
    peak_kv_blocks: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens proposed and verified
    accepted_tokens: int = 0  # of those, accepted
    verify_rows: int = 0  # sequences' verify steps that carried drafts
    kv: dict = field(default_factory=dict)  # kv_memory() of the finished sequences

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gained per verify step with drafts (its accepted drafts plus one)."""
        return (self.accepted_tokens + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0
