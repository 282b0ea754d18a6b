"""The input processor: every check a request must pass before the engine queues it, in one place.

Lengths (prompt, encoder input, the longest sequence), images and their placeholders, cross-attention states
that must fit the KV cache, grammars (compiled once, cached: structured.py) and the modules an adapter targets.
`Engine.add_request` runs `process` on every request. The server's edge calls single checks early
(server/limits.py, server/images.py), to say the typed refusals below in its request's own field names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.requests.image_states import with_state_layout
from loraplex.engine.scheduling.kv_cache import blocks_for
from loraplex.engine.requests.request import RequestRefused
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.lora.adapter import LoraAdapter
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.params import GrammarSpec, SamplingParams
from loraplex.engine.requests.grammars import GrammarError, GrammarLimits, Grammars, GrammarTooCostly


class PromptEmpty(RequestRefused):
    """The prompt has no tokens."""


class PromptTooLong(RequestRefused):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(f"prompt has {num_tokens} tokens; must be <= {limit} (max input length)")
        self.num_tokens, self.limit = num_tokens, limit


class SequenceTooLong(RequestRefused):
    """The prompt's share of the sequence (`in_sequence`: the prompt, or an encoder-decoder's start token) plus
    max_new_tokens passes the longest sequence."""

    def __init__(self, in_sequence: int, max_new_tokens: int, limit: int, decoder_start: bool) -> None:
        super().__init__(
            f"prompt tokens ({in_sequence}) + max_new_tokens ({max_new_tokens}) must be <= {limit} (max total tokens)"
        )
        self.in_sequence, self.max_new_tokens, self.limit, self.decoder_start = (
            in_sequence, max_new_tokens, limit, decoder_start)


class ImagesWithoutPlaceholders(RequestRefused):
    def __init__(self) -> None:
        super().__init__("the images have no placeholder tokens in the prompt")


@dataclass
class ProcessedInputs:
    """A checked request, its inputs as the engine queues them."""

    params: SamplingParams
    adapter: LoraAdapter | None
    prompt_ids: list[int]  # the decoder's prompt (an encoder-decoder model: its start token)
    encoder_ids: list[int] | None
    num_states: int
    images: ImageInputs | None
    image_digest: bytes
    grammar: object | None  # the request's own grammar matcher


class GrammarCache:
    """Compiled grammars, made at the first request that asks; compiled from any thread (the server compiles
    off the engine thread before it queues a request, so that queueing it only copies the compiled grammar)."""

    def __init__(self, tokenizer, model_config: ModelConfig, config: EngineConfig, on_first: Callable[[], None]):
        self.tokenizer, self.model_config, self.config, self.on_first = tokenizer, model_config, config, on_first
        self._grammars: Grammars | None = None
        self._used = False  # `on_first` called (at the first compile)
        self._made = threading.Lock()

    def prepare(self) -> None:
        """Import the grammar engine and read the tokenizer into it now, not at the first structured-output request:
        about a second's work that holds the interpreter (every thread, the event loop's too, waits), so the server
        has it done on a thread of its own as it starts (AsyncEngine.prepare_grammars)."""
        if self.tokenizer is None:
            return
        with self._made:
            if self._grammars is None:
                limits = GrammarLimits(self.config.max_grammar_bytes, self.config.grammar_compile_timeout_s)
                self._grammars = Grammars(
                    self.tokenizer.hf, self.model_config.vocab_size, tuple(self.tokenizer.eos_token_ids), limits
                )

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for `spec`; RequestRefused naming the problem (unusable, or over a limit)."""
        if self.tokenizer is None:
            raise RequestRefused("structured output needs the model's tokenizer")
        self.prepare()
        with self._made:
            if not self._used:
                self._used = True
                self.on_first()
        try:
            return self._grammars.compile(spec)
        except GrammarTooCostly as exc:
            raise RequestRefused(f"grammar refused: {exc}") from exc
        except GrammarError as exc:
            raise RequestRefused(f"invalid grammar: {exc}") from exc

    def matcher(self, spec: GrammarSpec):
        """A request's own matcher for `spec` (a copy of the compiled one)."""
        return self.compile(spec).deep_copy()


@dataclass(frozen=True)
class InputLimits:
    """The checks a request's sizes and images pass, from the model's fixed limits alone: the server runs them at
    its edge (from any thread), the input processor again when the request is queued."""

    model_id: str
    max_input_length: int
    max_total_tokens: int  # the longest sequence (prompt + generated) one request may reach
    is_encoder_decoder: bool
    takes_images: bool

    def sequence_tokens_of_prompt(self, num_prompt_tokens: int) -> int:
        """How much of a sequence's max total tokens a prompt takes: all of it for a decoder; for an
        encoder-decoder model only the decoder's start token (the prompt is the encoder's input)."""
        return 1 if self.is_encoder_decoder else num_prompt_tokens

    def check_prompt(self, num_prompt_tokens: int) -> None:
        if not num_prompt_tokens:
            raise PromptEmpty("the prompt is empty")
        if num_prompt_tokens > self.max_input_length:
            raise PromptTooLong(num_prompt_tokens, self.max_input_length)

    def check_sequence(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        in_sequence = self.sequence_tokens_of_prompt(num_prompt_tokens)
        if in_sequence + max_new_tokens > self.max_total_tokens:
            raise SequenceTooLong(in_sequence, max_new_tokens, self.max_total_tokens, in_sequence != num_prompt_tokens)

    def check_lengths(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        self.check_prompt(num_prompt_tokens)
        self.check_sequence(num_prompt_tokens, max_new_tokens)

    def check_takes_images(self) -> None:
        if not self.takes_images:
            raise RequestRefused(f"model {self.model_id!r} does not take images (it is a text-only model)")

    def check_images(self, prompt_ids: list[int], images: ImageInputs) -> None:
        self.check_takes_images()
        if not images.positions or images.positions[-1] >= len(prompt_ids) or images.num_images == 0:
            raise ImagesWithoutPlaceholders()


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, scheduler: Scheduler, *, limits: InputLimits,
        states_per_tile: int | None, lora_modules: Collection[str], grammars: GrammarCache,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model_config, self.config, self.scheduler, self.limits = model_config, config, scheduler, limits
        self.states_per_tile, self.lora_modules, self.grammars = states_per_tile, lora_modules, grammars
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back, besides a request's stop token ids

    @property
    def is_encoder_decoder(self) -> bool:
        return self.limits.is_encoder_decoder

    @property
    def image_token_id(self) -> int | None:
        """The token that stands for an image in a prompt (None: the model takes no images)."""
        config = self.model_config
        if config.mllama is not None:
            return config.mllama.image_token_id
        return config.vision.image_token_id if config.vision is not None else None

    # ---- the checks that need more than the limits -----------------------------------------------------

    def check_adapter(self, adapter: LoraAdapter) -> None:
        unknown = set(adapter.modules) - set(self.lora_modules)
        if unknown:
            raise RequestRefused(f"adapter {adapter.adapter_id!r} targets modules this model lacks: {sorted(unknown)[:3]}")

    def _check_encoder_input(self, encoder_ids: list[int]) -> None:
        """The encoder input must fit the model's positions."""
        most = self.model_config.encoder_decoder.max_source_positions
        if most is not None and len(encoder_ids) > most:
            raise RequestRefused(f"prompt has {len(encoder_ids)} tokens; the model's encoder takes at most {most}")

    def _check_states_fit(self, num_states: int, prompt_tokens: int, params: SamplingParams) -> None:
        """A request's cross-attention states and its longest sequence must fit the KV cache (the states take
        blocks of it too, of the token pool or of their own)."""
        config = self.scheduler.config
        bs = config.block_size
        state_blocks, token_blocks = blocks_for(num_states, bs), blocks_for(prompt_tokens + params.max_new_tokens, bs)
        if not self.scheduler.fits_alone(token_blocks, state_blocks):
            source = "of its images" if self.model_config.mllama is not None else "of its prompt, the encoder's input"
            capacity = (f"{config.num_blocks * bs} token slots and {config.num_state_blocks * bs} state slots"
                        if config.num_state_blocks else f"{config.num_blocks * bs} slots")
            raise RequestRefused(
                f"the request's {num_states} cross-attention states ({source}) and its {prompt_tokens} tokens + "
                f"max_new_tokens ({params.max_new_tokens}) do not fit the KV cache ({capacity})"
            )

    # ---- a whole request ---------------------------------------------------------------------------

    def process(
        self, prompt_ids: list[int], params: SamplingParams, adapter: LoraAdapter | None = None,
        images: ImageInputs | None = None,
    ) -> ProcessedInputs:
        """Check a request (RequestRefused saying why, at the first check it fails) and shape its inputs for the
        engine; `images` already expanded into placeholder tokens in the prompt."""
        if not prompt_ids:
            raise PromptEmpty("the prompt is empty")
        if images is not None:
            self.limits.check_images(prompt_ids, images)
        elif self.image_token_id is not None and self.image_token_id in prompt_ids:
            raise RequestRefused("the prompt has image tokens but no images came with it")
        num_prompt_tokens = len(prompt_ids)
        self.limits.check_prompt(num_prompt_tokens)
        # Before `images` is replaced below (a copy would hash the pixels again on this thread).
        image_digest = images.digest if images is not None and self.config.prefix_caching else b""
        encoder_ids, num_states = None, 0
        if self.is_encoder_decoder:  # the prompt is the encoder's input; the decoder starts from one token
            encoder_ids, prompt_ids = list(prompt_ids), [self.model_config.encoder_decoder.decoder_start_token_id]
            self._check_encoder_input(encoder_ids)
            num_states = len(encoder_ids)  # one state per encoder token
        if images is not None and self.model_config.mllama is not None:
            images = with_state_layout(
                images, len(prompt_ids), self.model_config.mllama.vision.max_num_tiles, self.states_per_tile
            )
            num_states = images.layout.num_states
        if num_states:
            self._check_states_fit(num_states, len(prompt_ids), params)
        self.limits.check_sequence(num_prompt_tokens, params.max_new_tokens)
        if params.min_tokens and not params.min_tokens_stops:  # the tokens that would end it early
            eos = () if params.ignore_eos else self.eos_token_ids
            params = replace(params, min_tokens_stops=tuple(sorted({*eos, *params.stop_token_ids})))
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        if adapter is not None:
            self.check_adapter(adapter)
        return ProcessedInputs(params, adapter, list(prompt_ids), encoder_ids, num_states, images, image_digest, grammar)
