"""Text that reaches the model from outside the job: tool results and environment messages
(and their errors). A tool's or an environment's author writes them, and the model must read
them as text, whatever they hold.

- A lone surrogate (``"\\ud800"``: JSON can carry one, UTF-8 cannot) would fail the tokenizer,
  and the whole job with it. :func:`clean_text` replaces each with U+FFFD (and
  :func:`clean_json` does so in a parsed JSON value, the model's tool-call arguments).
- A chat template's special tokens written inside such text (``<|im_start|>``, ``<|eot_id|>``)
  would otherwise be tokenised as real turn markers, so a tool result could forge a turn.
  :func:`outside` marks the text (:class:`OutsideText`), and :class:`PlainTextEncoder`
  tokenises a rendered conversation with every added token inside marked text written as the
  tokens of its characters: the template's own markers stay markers, the forged ones are text.

How: before rendering, each added token's string inside marked text is replaced with a
sentinel of private-use characters (no template writes them; any already in the text are
replaced with U+FFFD first); the render is then tokenised piece by piece, the pieces between
sentinels as usual and each sentinel as its token's string tokenised as plain text.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from jobspec.prompt_format import clean_json, clean_text

__all__ = ["OutsideText", "PlainTextEncoder", "clean_json", "clean_text", "outside"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # Unicode private use: the sentinel's brackets
_PRIVATE = re.compile(f"[{_OPEN}{_CLOSE}]")
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_REPLACEMENT = "\ufffd"


class OutsideText(str):
    """Text from a tool or an environment (see the module docstring): a ``str`` that the chat
    format tokenises as plain text."""

    __slots__ = ()


def outside(text: str) -> OutsideText:
    """``text`` cleaned (:func:`clean_text`) and marked as from outside."""
    return OutsideText(clean_text(str(text)))


class PlainTextEncoder:
    """Token ids of rendered conversations in which the added tokens of outside text are plain
    text (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        # Every string the tokenizer turns into one added token wherever it appears; longest
        # first, so that one token's string inside another's is never matched instead.
        self.specials: tuple[str, ...] = tuple(
            sorted({str(t) for t in decoder.values() if str(t)}, key=len, reverse=True)
        )
        self._added_ids = frozenset(int(i) for i in decoder)
        self._as_text: dict[int, list[int]] = {}

    def mark(self, text: OutsideText) -> str:
        """``text`` ready to render: each added token's string in it replaced with its
        sentinel."""
        plain = _PRIVATE.sub(_REPLACEMENT, str(text))
        present = [(k, s) for k, s in enumerate(self.specials) if s in plain]
        if not present:
            return plain
        pattern = re.compile("|".join(re.escape(s) for _, s in present))
        index = {s: k for k, s in present}
        return pattern.sub(lambda m: f"{_OPEN}{index[m.group(0)]}{_CLOSE}", plain)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of ``rendered`` (a chat template's output), each sentinel as its token's
        string in plain-text tokens."""
        if _OPEN not in rendered:  # no outside text held an added token: one tokenisation
            return self._ids(rendered)
        ids: list[int] = []
        at = 0
        for match in _SENTINEL.finditer(rendered):
            ids += self._ids(rendered[at : match.start()])
            ids += self._plain(int(match.group(1)))
            at = match.end()
        return ids + self._ids(rendered[at:])

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _plain(self, k: int) -> list[int]:
        """The plain-text tokens of added token ``k``'s string."""
        if k not in self._as_text:
            text = self.specials[k]
            kw = {"add_special_tokens": False, "split_special_tokens": True}
            ids = list(self.tokenizer(text, **kw)["input_ids"])
            if self._added_ids.intersection(ids):
                # An added token that is not "special" is matched even then; one character at a
                # time, no added token of several characters can match.
                ids = [i for ch in text for i in self.tokenizer(ch, **kw)["input_ids"]]
            self._as_text[k] = ids
        return self._as_text[k]
