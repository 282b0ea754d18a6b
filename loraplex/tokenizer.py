"""Tokenizer wrapper, chat template, incremental detokenizer and stop-string search.

Text is always decoded with ``clean_up_tokenization_spaces=False``: the clean-up rewrites spaces around
punctuation depending on what follows, which would make streamed pieces disagree with the final text.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first generated token, so that the first piece gets its leading space
# right (SentencePiece drops the space of a text's first word). TGI and vLLM use 5 as well.
_PROMPT_CONTEXT = 5


class Tokenizer:
    """Wraps a transformers fast tokenizer."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        eos = set(extra_eos_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # all_special_ids lists only the named specials (bos/eos/...); added tokens marked special count too.
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self._special_ids = frozenset(hf.all_special_ids) | {i for i, tok in added.items() if tok.special}

    @classmethod
    def from_pretrained(
        cls,
        path_or_hf_tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
        *,
        extra_eos_ids: Iterable[int] = (),
        **kwargs: Any,
    ) -> Tokenizer:
        """From a directory (or hub id, or a ``.gguf`` file), or an already-built transformers tokenizer.

        ``kwargs`` go to ``AutoTokenizer.from_pretrained`` (e.g. ``gguf_file=``).
        """
        if isinstance(path_or_hf_tokenizer, PreTrainedTokenizerBase):
            return cls(path_or_hf_tokenizer, extra_eos_ids)
        path = Path(path_or_hf_tokenizer)
        if path.suffix == ".gguf" and path.is_file():
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        else:
            hf = AutoTokenizer.from_pretrained(str(path_or_hf_tokenizer), **kwargs)
        return cls(hf, extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                "use the plain completion API with a prompt string instead"
            )
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        assert isinstance(text, str)
        return text

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the `tools` it is given (many templates ignore them)."""
        name = "loraplex_probe_tool"
        probe = {"type": "function", "function": {"name": name, "description": "", "parameters": {"type": "object"}}}
        try:
            return name in self.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
        except Exception:  # noqa: BLE001 — no template, or one that refuses tools: it does not render them
            return False

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary string's length, which for
        byte-level BPE counts bytes (at least one per character) and for SentencePiece and WordPiece counts the
        piece with its markers. A text longer than n times this cannot be fewer than n tokens (unless the
        tokenizer's normalizer deletes characters)."""
        return max((len(piece) for piece in self.hf.get_vocab()), default=1)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_text(self, token_id: int) -> str:
        """The text of one token as a client sees it (a lone piece of a multi-byte character shows as U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; never emits half a UTF-8 character.

    TGI's prefix_offset / read_offset scheme: decode a short window of recent ids twice, without and with the
    ids not yet emitted, and emit the difference. A window ending in U+FFFD is an incomplete character
    (a byte-level BPE or byte-fallback sequence cut short): hold it back until a later token completes it.
    The window starts with the last few prompt tokens, so the first piece continues the prompt text (with a
    SentencePiece tokenizer it keeps the leading space that decoding the generated ids alone would drop).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - _PROMPT_CONTEXT) :])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # ids before this are already emitted (or are prompt)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached while the offsets stay put
        self.text = ""  # all generated text emitted so far (the prompt excluded)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes ('' while a character is incomplete)."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        piece = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        # Drop ids before the window so memory stays bounded over long generations.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        piece = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        self.text += piece
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, new_text_len: int, stops: Sequence[str]) -> int | None:
    """Index in ``text`` where the earliest-starting stop string matches, or None.

    Only matches that end inside the last ``new_text_len`` characters count: older matches were already
    seen when their text arrived, and only the tail that a new match could touch is scanned.
    """
    best: int | None = None
    boundary = len(text) - new_text_len  # first index of the new text
    for stop in stops:
        if not stop:
            continue
        # A match starting here or later ends at boundary + 1 or later, i.e. inside the new text.
        at = text.find(stop, max(0, boundary - len(stop) + 1))
        if at != -1 and (best is None or at < best):
            best = at
    return best
