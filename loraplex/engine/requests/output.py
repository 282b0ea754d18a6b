"""Output processing: a sampled token joins its request (appended, or written into its placeholder), is
detokenized and checked against the stop conditions; what a client hears of it is a `RequestOutput`.

`OutputProcessor.append` only decides: it returns the token and whether (and why) the request is finished or
failed; the engine acts on that (frees the request) and then asks for the final output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.worker.overlap import PENDING
from loraplex.engine.requests.request import Request
from loraplex.engine.sampling.verification import SampledToken
from loraplex.params import FinishReason, PromptScore, TokenInfo
from loraplex.engine.requests.grammars import advance
from loraplex.tokenizer import IncrementalDetokenizer, find_stop


@dataclass
class RequestOutput:
    """One request's news about one new token (a step with accepted drafts gives a request several, in
    order), and the result when finished."""

    request_id: str
    token: TokenInfo | None
    finished: bool = False
    finish_reason: FinishReason | None = None
    generated_text: str | None = None  # when finished: the whole text, stop sequence cut
    token_ids: list[int] | None = None  # when finished: every generated token id
    prompt_tokens: list[TokenInfo] | None = None  # when finished and prompt logprobs were asked for
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    token_times: list[float] | None = None  # when finished: when each generated token was made (monotonic)
    error: str | None = None  # set (with finished=True) when the request failed; the text says why
    embedding: list[float] | None = None  # when an embedding request finished: its vector


@dataclass
class Stream:
    """Engine-side per-request state that the scheduler does not need."""

    detokenizer: IncrementalDetokenizer | None
    text_end: int | None = None  # where the stop sequence begins, once matched
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class Appended:
    """What became of one sampled token: the token as reported, and the decision for its request."""

    token: TokenInfo | None
    finish: FinishReason | None = None  # the request is finished, for this reason
    error: str | None = None  # the request fails (its grammar refused the token)


def failed_output(request: Request, message: str) -> RequestOutput:
    return RequestOutput(request.request_id, None, finished=True, seed=request.seed, error=message)


class OutputProcessor:
    """The requests' streams (detokenizer, stop-sequence cut, token times), by request id."""

    def __init__(self, tokenizer, eos_token_ids, max_total_tokens: int) -> None:
        self.tokenizer = tokenizer  # None: a model run without one (ids only)
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else frozenset(eos_token_ids)
        self.max_total_tokens = max_total_tokens
        self._streams: dict[str, Stream] = {}

    def open(self, request: Request) -> None:
        params = request.params
        detok = (
            IncrementalDetokenizer(self.tokenizer, request.prompt_ids, params.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        self._streams[request.request_id] = Stream(detok)

    def close(self, request_id: str) -> Stream | None:
        return self._streams.pop(request_id, None)

    def append(self, request: Request, result: SampledToken, now: float, place: int | None = None) -> Appended:
        """`place`: the index of the token's placeholder in output_ids (engine/worker/overlap.py); None: appended."""
        token_id = result.token_id
        stream = self._streams[request.request_id]
        stream.first_token_time = stream.first_token_time or now
        stream.token_times.append(now)
        if place is None:
            request.output_ids.append(token_id)
        else:
            assert request.output_ids[place] == PENDING, "a placeholder is written once"
            request.output_ids[place] = token_id
            request.num_pending -= 1
        if request.grammar is not None:
            error = advance(request.grammar, token_id)
            if error is not None:
                return Appended(None, error=error)
        piece = stream.detokenizer.add(token_id) if stream.detokenizer else ""
        token = TokenInfo(
            id=token_id,
            text=piece,
            logprob=result.logprob,
            special=self.tokenizer.is_special(token_id) if self.tokenizer else False,
            top_tokens=[self.token_info(t, lp) for t, lp in result.top_tokens],
        )
        reason = self._finish_reason(request, token_id, piece, stream)
        if reason is not None and reason is not FinishReason.STOP_SEQUENCE and stream.detokenizer is not None:
            token.text += stream.detokenizer.flush()  # bytes held back for an unfinished character
        return Appended(token, finish=reason)

    def _finish_reason(self, request: Request, token_id: int, piece: str, stream: Stream) -> FinishReason | None:
        params = request.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return FinishReason.EOS_TOKEN
        if request.grammar is not None and request.grammar.is_stopped():  # complete, its end token taken
            return FinishReason.EOS_TOKEN
        if params.stop and stream.detokenizer is not None and len(request.output_ids) >= params.min_tokens:
            text = stream.detokenizer.text
            stop_at = find_stop(text, len(piece), params.stop)
            if stop_at is not None:
                if params.include_stop_str_in_output:  # kept: the longest stop string that starts there
                    stop_at += max(len(s) for s in params.stop if text.startswith(s, stop_at))
                stream.text_end = stop_at
                return FinishReason.STOP_SEQUENCE
        if len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def final_output(self, request: Request, token: TokenInfo | None, stream: Stream, now: float,
                     embedding: list[float] | None = None) -> RequestOutput:
        """The finished request's result (after the engine freed it: its placeholders are gone); an embedding
        request's carries its vector."""
        text = stream.detokenizer.text[: stream.text_end] if stream.detokenizer else ""
        prompt_tokens = None
        # An encoder's input is encoded, not predicted: it has no logprobs (None: the caller says so).
        if request.params.prompt_logprobs and request.prompt_logprobs is not None and request.encoder_ids is None:
            prompt_tokens = [self.prompt_token(t, score) for t, score in zip(request.prompt_ids, request.prompt_logprobs)]
        timings = {
            "queue": (request.first_scheduled_time or now) - request.arrival_time,
            "first_token": (stream.first_token_time or now) - request.arrival_time,
            "total": now - request.arrival_time,
        }
        return RequestOutput(
            request.request_id, token, finished=True, finish_reason=request.finish_reason, generated_text=text,
            token_ids=list(request.output_ids),
            prompt_tokens=prompt_tokens, num_prompt_tokens=request.num_input_tokens,
            num_generated_tokens=len(request.output_ids), seed=request.seed, timings=timings,
            token_times=stream.token_times, embedding=embedding,
        )

    def prompt_token(self, token_id: int, score: PromptScore | None) -> TokenInfo:
        """A prompt token with its score (None: nothing predicts it, or the head cannot produce it)."""
        if score is None:
            return self.token_info(token_id, None)
        token = self.token_info(token_id, score.logprob)
        token.rank, token.top_tokens = score.rank, [self.token_info(t, lp) for t, lp in score.top]
        return token

    def token_info(self, token_id: int, logprob: float | None) -> TokenInfo:
        if self.tokenizer is None:
            return TokenInfo(token_id, "", logprob)
        return TokenInfo(token_id, self.tokenizer.token_text(token_id), logprob, self.tokenizer.is_special(token_id))
