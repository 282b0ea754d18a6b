"""vLLM's utility routes' bodies (server/vllm_routes.py), and POST /tokenize's three bodies: TGI's (`inputs`) and
vLLM's completion (`prompt`) and chat (`messages`) bodies, told apart by which of the three fields they give."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Field, GetJsonSchemaHandler, RootModel, Tag, TypeAdapter
from pydantic.json_schema import JsonSchemaValue

from loraplex.protocol.base import RequestModel
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.native import TokenizeRequest
from loraplex.protocol.openai import ChatMessage, refuse_unserved
from loraplex.protocol.tools.definitions import ToolDefinition, ToolPlan, plan_tools

# A static ceiling on /detokenize's list, past any model's context: its validation stops at the first id past it
# (the route then bounds the list by the model's --max-total-tokens, server/vllm_routes.py).
DETOKENIZE_MAX_TOKENS = 1 << 21


class DetokenizeRequest(RequestModel):
    model: str | None = None  # a served name or adapter (vLLM checks it); the text is the base tokenizer's
    tokens: list[int] = Field(max_length=DETOKENIZE_MAX_TOKENS)


class TokenizeCompletionRequest(RequestModel):
    """vLLM's completion body: `prompt`'s tokens, as /v1/completions reads a text prompt."""

    model: str | None = None  # a served name or adapter (404 otherwise); the tokens are the base tokenizer's
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False  # each token's vocabulary string beside its id


class TokenizeChatRequest(RequestModel):
    """vLLM's chat body: the ids /v1/chat/completions would give the engine for these messages (its template, image
    placeholders and limits); vLLM's template switches served, its other template fields refused unless unset."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # open the assistant's answer (what the chat route always does)
    continue_final_message: bool = False  # the last message left open, to be continued
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool | None = False
    tools: list[ToolDefinition] | None = None  # offered in the prompt as the chat route offers them
    # Refused unless unset or empty (as the chat route refuses them): the model's own template is used, as it is.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        refuse_unserved(self, TOKENIZE_CHAT_REFUSED_AT)
        if self.add_generation_prompt and self.continue_final_message:  # as vLLM refuses them
            raise Unsupported("add_generation_prompt and continue_final_message cannot both be true (the first opens "
                              "a new assistant message, the second leaves the last message open)",
                              "continue_final_message")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, None, None)  # offered as the chat route offers them without a tool_choice


# Chat tokenize fields refused unless at these values (the chat route refuses them alike).
TOKENIZE_CHAT_REFUSED_AT: dict[str, tuple[Any, ...]] = {
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
}


# The field that tells each body apart -> its model, and how errors name it.
TOKENIZE_SHAPES: dict[str, tuple[type[RequestModel], str]] = {
    "inputs": (TokenizeRequest, "TGI's body"),
    "prompt": (TokenizeCompletionRequest, "vLLM's completion body"),
    "messages": (TokenizeChatRequest, "vLLM's chat body"),
}
_EVERY_FIELD = {name for model, _ in TOKENIZE_SHAPES.values() for name in model.model_fields}


_ONE_OF = "a tokenize body gives exactly one of inputs (TGI's body), prompt (vLLM's completion body) or messages " \
          "(vLLM's chat body)"
_UNION = Annotated[Union[
    Annotated[TokenizeRequest, Tag("inputs")],
    Annotated[TokenizeCompletionRequest, Tag("prompt")],
    Annotated[TokenizeChatRequest, Tag("messages")],
], Discriminator(lambda body: next((k for k, (m, _) in TOKENIZE_SHAPES.items() if isinstance(body, m)), None))]


class TokenizeBody(RootModel[dict[str, Any]]):
    """POST /tokenize's body as sent: TGI's (`inputs`; answered as TGI does) or one of vLLM's (`prompt`, `messages`;
    answered as vLLM does). Documented as the three shapes; `shape()` says which one it is (a body that gives two of
    them, or none, or a field of another shape, is refused by name), and the route validates it as that one (so
    that an error names the field as the shape has it)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return handler(TypeAdapter(_UNION).core_schema)

    def shape(self) -> type[RequestModel]:
        """The model this body is one of; Unsupported naming the fields when it is none of them."""
        given = [key for key in TOKENIZE_SHAPES if key in self.root]
        if len(given) != 1:
            raise Unsupported(f"{_ONE_OF}; got {' and '.join(given) or 'none of them'}", ", ".join(given) or "inputs")
        model, name = TOKENIZE_SHAPES[given[0]]
        foreign = [str(key) for key in self.root if key in _EVERY_FIELD and key not in model.model_fields]
        if foreign:
            raise Unsupported(
                f"{', '.join(foreign)} {'is not a field' if len(foreign) == 1 else 'are not fields'} of {name} "
                f"({given[0]}): {'it belongs' if len(foreign) == 1 else 'they belong'} to another of this route's bodies",
                foreign[0])
        return model
