"""A request's text as its tokens arrive: incremental detokenization, stop strings, and holding back
a tail that may still become one.

    text = RequestText(tokenizer, stop=("\\n\\n",))
    for token in tokens:                      # end tokens are not pushed: they have no text
        stopped = text.push(token)            # True: a stop string completed, text cut before it
        new = text.take(final=stopped)        # newly final text for the caller
        if stopped: break

The Engine uses one per request when it detokenizes itself (generate, stream); behind the server
the AsyncEngine turns that off and runs these in the event loop's thread instead, so the step
loop never detokenizes: a stop string found there aborts the request in the engine.
"""
from __future__ import annotations


class RequestText:
    def __init__(self, tokenizer, stop=()):
        self.stream = tokenizer.stream() if tokenizer is not None else None
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # a tail that may start a stop string
        self.text = ""  # everything so far (cut at a stop string)
        self.emitted = 0  # characters already taken

    def push(self, token: int) -> bool:
        """Append a token's text; True when that completes a stop string (the text then ends before it).
        A stop string found now ends in the new text, so only the tail it can start in is searched (a
        search of the whole text made a long answer's stops quadratic)."""
        old = len(self.text)
        if self.stream is not None:
            self.text += self.stream.push(token)
        if not self.stop:
            return False
        cut = min((i for i in (self.text.find(s, max(0, old - len(s) + 1)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text that became final since the last call (all of it once the request is finished)."""
        upto = max(self.emitted, len(self.text) - (0 if final else self.hold))
        new, self.emitted = self.text[self.emitted:upto], upto
        return new

    @property
    def taken(self) -> str:
        return self.text[:self.emitted]
