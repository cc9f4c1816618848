"""Tokenizer: tokenizer.json through `tokenizers`, the chat template through jinja2.

The chat template is rendered the way Hugging Face transformers renders it: a sandboxed
jinja2 environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a tojson
filter that does not escape HTML, and the globals raise_exception, strftime_now, dict and
namespace; the context holds messages, add_generation_prompt, tools, documents and the
special tokens as strings (bos_token, eos_token, unk_token, pad_token).

BOS: `encode(text)` adds what the tokenizer.json post-processor adds (Llama 3 adds
<|begin_of_text|>, SmolLM2 adds nothing). A rendered chat usually contains the BOS text
already, so `encode_chat` encodes it with add_special_tokens=False.

Stop tokens (`eos_token_ids`): generation_config.json eos_token_id, config.json eos_token_id
and tokenizer_config.json eos_token, together.

Streaming: `stream().push(id)` returns the text that became final with that token. Text is
decoded over a short window of recent ids and held back while it ends in U+FFFD, so a
character split over several byte-level tokens comes out whole, once.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from ..errors import CuinferError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CuinferError(f"{path}: not valid JSON ({e})") from None


def _token_text(value):
    """tokenizer_config stores a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value) -> set:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """A jinja2 template compiled in an environment like transformers' (see module doc)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=dict, namespace=jinja2.utils.Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


class Tokenizer:
    def __init__(self, tokenizer, chat_template: str | None, special_tokens: dict, eos_token_ids):
        self._tok = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # "bos_token" -> text, ...
        self.eos_token_ids = set(eos_token_ids)
        bos = special_tokens.get("bos_token")
        self.bos_token_id = None if bos is None else tokenizer.token_to_id(bos)

    @classmethod
    def from_pretrained(cls, path) -> Tokenizer:
        """From a checkpoint directory holding tokenizer.json (+ tokenizer_config.json,
        chat_template.jinja, generation_config.json, config.json when present)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise CuinferError(f"{file}: no such file (cuinfer reads tokenizers from tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise CuinferError(f"{file}: cannot load tokenizer ({e})") from None
        tconf = _read_json(path / "tokenizer_config.json")
        template = tconf.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        special = {k: _token_text(tconf.get(k)) for k in SPECIAL_TOKEN_KEYS if tconf.get(k)}
        eos = _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        eos |= _ids(_read_json(path / "config.json").get("eos_token_id"))
        if special.get("eos_token") is not None and tok.token_to_id(special["eos_token"]) is not None:
            eos.add(tok.token_to_id(special["eos_token"]))
        return cls(tok, template, special, eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The rendered chat text, as transformers' apply_chat_template(tokenize=False) gives it."""
        if self.chat_template is None:
            raise CuinferError("this tokenizer has no chat template (tokenizer_config.json has no "
                               "chat_template): pass a plain prompt")
        import jinja2

        context = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        try:
            return compile_chat_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, or a bad template
            raise CuinferError(f"chat template: {e}") from None

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list:
        """Token ids of the rendered chat; the template supplies any BOS text itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self, skip_special_tokens)


class TextStream:
    """Incremental detokenizer: push(id) -> newly final text, flush() -> whatever is left.

    Decoding a window of ids rather than single ids keeps what the decoder does with context
    (byte-level merges, SentencePiece's leading-space rule); `prefix` marks where the window's
    already-emitted text starts and `read` where the not-yet-emitted ids start.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list = []
        self.prefix = self.read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # an incomplete character (or nothing new yet): wait for more ids
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """The rest, even if it ends mid-character (then with U+FFFD, as decode gives it)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]


# A chatml template as SmolLM2 uses, for the generated tokenizer
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces; "
    "numbers like 0123456789 and code such as def f(x): return x * 2 appear too. "
    "Hello, world! How are you today? I am fine, thank you. The model reads and writes text.\n"
)


def write_tiny_tokenizer(out_dir, vocab_size: int = 512):
    """Write tokenizer.json + tokenizer_config.json of a small byte-level BPE tokenizer.

    Trained on a fixed sentence, so it is the same everywhere and needs no download. Ids:
    <|endoftext|> 0, <|im_start|> 1 (BOS), <|im_end|> 2 (EOS), then the 256 byte symbols and
    merges up to vocab_size. Every string encodes (bytes fall back to byte symbols).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_CORPUS] * 4, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": specials[1], "eos_token": specials[2], "unk_token": specials[0],
              "pad_token": specials[0], "chat_template": CHATML_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
