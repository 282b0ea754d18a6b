"""An OpenAI request checked and turned into engine jobs (one per choice): the sampling fields against the model (token
ids in its vocabulary, bad words as its token sequences), n and best_of against a request's share of the seats, the
prompt or messages tokenized and bounded (server/limits.py), grammars compiled. The routes (openai_routes.py) run the
jobs and render their answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TypeVar

from loraplex.multimodal import split_chat_images
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.params import SamplingParams
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from loraplex.protocol.tools.definitions import ToolPlan
from loraplex.server.admission import Overloaded, sequences_per_request
from loraplex.server.chat_tools import ToolAnswers, chat_prompt
from loraplex.server.errors import BadRequest
from loraplex.server.grammars import compile_grammars
from loraplex.server.images import check_takes_images, encode_prompt
from loraplex.server.limits import check_prompt_and_budget, check_stop_sequences, check_token_ids
from loraplex.server.state import ServerState

T = TypeVar("T")


# ---- validation -> engine inputs -----------------------------------------------------------------


@dataclass
class Job:
    """One choice: one engine request."""

    index: int  # the choice index (before best_of selection)
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # prepended to the text (completions `echo`)
    images: ImageInputs | None = None  # chat messages' images (shared by the n choices: read-only)


def sampling_params(
    state: ServerState, body: SamplingFields, max_tokens: int, top_n: int = 0, prompt_top_n: int | None = None
) -> SamplingParams:
    """`top_n`: alternatives per generated token; `prompt_top_n`: per prompt token (None: the prompt is not scored)."""
    check_stop_sequences(state, len(body.stops))
    check_token_ids(state, "stop_token_ids", body.stop_token_ids or ())
    check_token_ids(state, "logit_bias", [token for token, _ in body.token_bias()])
    check_token_ids(state, "allowed_token_ids", body.allowed_token_ids or ())
    if body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    params = body.with_defaults(state.sampling_defaults).to_sampling_params(
        max_tokens, top_n, prompt_top_n is not None, prompt_top_n or 0)
    return replace(params, bad_words_ids=bad_words_ids(state, body.bad_words or ())) if body.bad_words else params


def bad_words_ids(state: ServerState, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it is and after a space (mid-sentence, most tokenizers
    fold the space into the word's first token)."""
    sequences = set()
    for word in words:
        for text in (word, " " + word):
            ids = tuple(state.tokenizer.encode(text, add_special_tokens=False))
            if ids:
                sequences.add(ids)
    return tuple(sorted(sequences))


def refusing(method: Callable[[], T]) -> T:
    """Call a protocol check; what it refuses is a 400 naming the field."""
    try:
        return method()
    except Unsupported as exc:
        raise BadRequest(str(exc), exc.param) from exc


def check_share(state: ServerState, n: int, runs: int, prompts: int) -> None:
    """A request makes `runs` sequences per prompt (n, or best_of when larger), each taking a seat of
    --max-concurrent-requests: more than one request's share (`sequences_per_request`) is refused at once, 400
    naming the field, so that one request cannot take every seat (issue 58)."""
    limit = state.config.max_concurrent_requests
    share = sequences_per_request(limit, state.config.max_sequences_per_request)
    if runs * prompts <= share:
        return
    param = "best_of" if runs > n else "n" if runs > 1 else "prompt"
    what = "the number of prompts" if param == "prompt" else param
    if param != "prompt" and prompts > 1:
        what += " times the number of prompts"
    raise BadRequest(
        f"{what} must be <= {share} (--max-sequences-per-request; by default a quarter of --max-concurrent-requests "
        f"{limit}, so that one request leaves seats for the others); got {runs * prompts}", param,
    )


def fan_out(params: SamplingParams, count: int) -> list[SamplingParams]:
    """`count` runs of one prompt; with a seed, run i gets seed + i so that the choices differ."""
    if params.seed is None:
        return [params] * count
    return [replace(params, seed=(params.seed + i) % 2**64) for i in range(count)]


# Fill-in-the-middle tokens (prefix, suffix, middle) as tokenizers name them: StarCoder's, Qwen2.5-Coder's, SantaCoder's.
FIM_TOKEN_NAMES = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
)


@lru_cache(maxsize=8)
def fim_token_ids(hf_tokenizer) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) token ids, or None when its vocabulary has no such three."""
    vocab = hf_tokenizer.get_vocab()
    for names in FIM_TOKEN_NAMES:
        if all(name in vocab for name in names):
            return tuple(vocab[name] for name in names)  # type: ignore[return-value]
    return None


def fill_in_the_middle(state: ServerState, body: CompletionRequest) -> tuple[int, int, int] | None:
    """`suffix`'s tokens (None without a suffix); a 400 naming suffix where the model has none."""
    if not body.suffix:
        return None
    fim = fim_token_ids(state.tokenizer.hf)
    if fim is None:
        raise BadRequest("suffix needs fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, <fim_middle>), and "
                         "this model's tokenizer has no fill-in-the-middle tokens", "suffix")
    if body.echo:
        raise BadRequest("echo cannot be combined with suffix", "suffix")
    if body.truncate_prompt_tokens is not None:
        raise BadRequest("truncate_prompt_tokens cannot be combined with suffix", "truncate_prompt_tokens")
    state.validation.check_length(body.suffix, "suffix")
    return fim


def prompt_scores(state: ServerState, body: SamplingFields, echo: bool = False, logprobs: int | None = None) -> int | None:
    """How many likeliest tokens the engine reports per prompt token, or None when the prompt is not scored: vLLM's
    prompt_logprobs, or completions' echo with logprobs (its prompt tokens carry top_logprobs as its generated ones
    do). An encoder-decoder model's prompt is encoded, not predicted: it has none (400)."""
    wanted = body.prompt_logprobs is not None or (echo and logprobs is not None)
    if wanted and state.model.is_encoder_decoder:
        param = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        what = "prompt_logprobs asks" if param == "prompt_logprobs" else "echo with logprobs asks"
        raise BadRequest(
            f"{what} for the prompt's logprobs, which an encoder-decoder model does not define "
            f"(its prompt is encoded, not predicted); drop {'it' if param == 'prompt_logprobs' else 'echo or logprobs'}",
            param,
        )
    return max(body.prompt_logprobs or 0, (logprobs or 0) if echo else 0) if wanted else None


def truncated(state: ServerState, ids: list[int], keep: int | None, images: ImageInputs | None = None):
    """vLLM's truncate_prompt_tokens: only the last `keep` prompt tokens (left truncation), never cutting an image
    (as the native API's truncate)."""
    if keep is None or keep >= len(ids):
        return ids, images
    if images is not None and images.positions and images.positions[0] < len(ids) - keep:
        raise BadRequest(f"truncate_prompt_tokens={keep} would cut an image's tokens out of the prompt",
                         "truncate_prompt_tokens")
    ids = ids[-keep:]
    return ids, images.for_ids(ids) if images is not None else None


async def prepare_completion(state: ServerState, body: CompletionRequest) -> list[Job]:
    refusing(body.check)
    body.log_ignored()
    prompts = body.prompts()
    if not prompts:
        raise BadRequest("prompt must not be empty", "prompt")
    n, runs = body.choices_per_prompt, body.best_of or body.choices_per_prompt
    if runs > max(n, state.config.max_best_of):
        raise BadRequest(f"best_of > n must be <= {state.config.max_best_of} (max best of); got {runs}", "best_of")
    check_share(state, n, runs, len(prompts))
    prompt_top_n = prompt_scores(state, body, bool(body.echo), body.logprobs)
    fim = fill_in_the_middle(state, body)
    max_tokens = body.max_tokens or default_max_tokens(state, 16)
    params = sampling_params(state, body, max_tokens, body.logprobs or 0, prompt_top_n)
    tokenizer = state.tokenizer
    add_special = body.add_special_tokens is not False and fim is None  # FIM: the prefix token opens the prompt
    suffix_ids = await state.validation.run(tokenizer.encode, body.suffix, add_special_tokens=False) if fim else []
    jobs = []
    for p, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            state.validation.check_length(prompt, "prompt")
            ids, text = await state.validation.run(tokenizer.encode, prompt, add_special_tokens=add_special), prompt
        else:
            if any(not 0 <= i < tokenizer.vocab_size for i in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
        if fim is not None:  # StarCoder's PSM order: <prefix> prompt <suffix> suffix <middle>
            ids = [fim[0], *ids, fim[1], *suffix_ids, fim[2]]
        if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < len(ids):
            ids, _ = truncated(state, ids, body.truncate_prompt_tokens)
            text = tokenizer.decode(ids, skip_special_tokens=False)  # what the model read (the echo)
        check_prompt_and_budget(state, ids, max_tokens, "prompt", "max_tokens")
        for k, sp in enumerate(fan_out(params, runs)):
            jobs.append(Job(p * runs + k, p, ids, sp, text if body.echo else ""))
    await compile_grammars(state, [body.output_constraint()])
    return jobs


def default_max_tokens(state: ServerState, api_default: int) -> int:
    """What a request without max_tokens may generate: the API's default, within `--default-max-tokens`."""
    cap = state.config.default_max_tokens
    return api_default if cap is None else min(api_default, cap)


async def chat_ids(
    state: ServerState, messages: list[dict], plan: ToolPlan, add_special_tokens: bool, add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> tuple[list[int], ImageInputs | None]:
    """The ids (and images) chat messages give the engine: the model's template with the tools' plan, each image's
    placeholder tokens as its processor expands them (/v1/chat/completions, and vLLM's chat body of /tokenize)."""
    urls: list[str] = []
    if any(isinstance(m["content"], list) for m in messages):  # image parts: {"type": "image"} + their URLs
        messages, urls = split_chat_images(messages)
        check_takes_images(state, "messages")
    try:  # templates can be slow: off the loop
        prompt = await state.validation.run(chat_prompt, state, messages, plan, add_generation_prompt,
                                            continue_final_message)
    except Overloaded:  # the validation workers are busy: a 429, not the messages' fault
        raise
    except Exception as exc:  # no template, or the template refused these messages
        raise BadRequest(f"messages cannot be turned into a prompt: {exc}", "messages") from exc
    return await encode_prompt(state, prompt, urls, add_special_tokens, "messages")


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> tuple[list[Job], ToolAnswers]:
    """The request's jobs, and how to read their answers (text, or tool calls)."""
    refusing(body.check)
    body.log_ignored()
    check_share(state, body.choices_per_prompt, body.choices_per_prompt, 1)
    prompt_top_n = prompt_scores(state, body)
    plan = refusing(body.tool_plan)
    ids, images = await chat_ids(state, refusing(body.template_messages), plan, bool(body.add_special_tokens))
    ids, images = truncated(state, ids, body.truncate_prompt_tokens, images)
    room = state.model.max_total_tokens - state.model.limits.sequence_tokens_of_prompt(len(ids))
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens(state, max(1, room))
    check_prompt_and_budget(state, ids, max_tokens, "messages", "max_tokens")
    top_n = (body.top_logprobs or 0) if body.logprobs else 0
    params = sampling_params(state, body, max_tokens, top_n, prompt_top_n)
    # Every tool's schema is compiled too, whatever the choice: a tool that could never be constrained is refused.
    await compile_grammars(state, [body.output_constraint(), *plan.schemas()])
    jobs = [Job(k, 0, ids, sp, images=images) for k, sp in enumerate(fan_out(params, body.choices_per_prompt))]
    return jobs, ToolAnswers.of(state, plan)
