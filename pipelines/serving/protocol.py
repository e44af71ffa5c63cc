"""The OpenAI-compatible wire format: pydantic models for the requests and responses of
/v1/completions and /v1/chat/completions, and the error body.

Requests are validated here, at the boundary: anything a model refuses becomes a 400 with an
OpenAI-style error body before it reaches the engine. Unknown request fields are ignored (OpenAI
clients send many optional ones); the fields below are the ones honoured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from domino.decoding import GenerationConfig, GenerationResult
from domino.sampling import SamplingParams

# Optional response fields are left out of the JSON when unset (OpenAI omits them too).
OMIT_WHEN_NONE = dict(default=None, exclude_if=lambda value: value is None)


# -- errors ----------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str  # "invalid_request_error", "not_found_error" or "server_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- requests --------------------------------------------------------------------------------------


class GenerationRequest(BaseModel):
    """The fields both endpoints share: which model, how long, how to sample, when to stop."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: int | None = Field(None, gt=0, description="new tokens at most")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="extension: keep the k most likely tokens (0 turns it off)")
    stop: str | list[str] | None = Field(None, description="stop strings; the text ends before them")
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False

    def generation_config(self, prompt_tokens: int, context: int) -> GenerationConfig:
        """The engine's config. Without max_tokens, the request may fill the rest of the context."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, context - prompt_tokens)  # an over-long prompt is refused by the engine
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationConfig(max_new_tokens=max_tokens, stop_strings=stop, seed=self.seed,
                                sampling=SamplingParams(self.temperature, self.top_p, self.top_k))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = Field(description="raw text (no chat template) or token ids")
    max_tokens: int | None = Field(16, gt=0, description="new tokens at most (OpenAI's default: 16)")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        """The {role, content} dict a chat template expects, text parts joined."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0, description="OpenAI's newer name for max_tokens")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(**OMIT_WHEN_NONE)
    content: str | None = Field(**OMIT_WHEN_NONE)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None


class ResponseBase(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = Field(**OMIT_WHEN_NONE)
    # Extension: the request's speculative-decoding statistics (tau, rounds, acceptance by
    # position, time split), as domino's GenerationStats.as_dict(). Set on the final object only.
    domino: dict[str, Any] | None = Field(**OMIT_WHEN_NONE)


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "domino"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- building responses from a generation ----------------------------------------------------------


def usage(result: GenerationResult) -> Usage:
    prompt, completion = result.stats.prompt_tokens, len(result.tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ResponseIds(BaseModel):
    """What every object of one response repeats."""

    id: str
    created: int
    model: str


def complete_response(chat: bool, ids: ResponseIds, result: GenerationResult
                      ) -> CompletionResponse | ChatCompletionResponse:
    """The whole reply of a request that is not streamed."""
    final = dict(**ids.model_dump(), usage=usage(result), domino=result.stats.as_dict())
    text, finish = result.text or "", result.finish_reason
    if chat:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)
        return ChatCompletionResponse(**final, choices=[choice])
    return CompletionResponse(**final, choices=[CompletionChoice(text=text, finish_reason=finish)])


def chunk(chat: bool, ids: ResponseIds, text: str | None, result: GenerationResult | None = None,
          role: bool = False) -> CompletionResponse | ChatCompletionChunk:
    """One streamed object: new text, or (with `result`) the last one, carrying the finish reason,
    usage and statistics."""
    final = dict(usage=usage(result), domino=result.stats.as_dict()) if result is not None else {}
    finish = result.finish_reason if result is not None else None
    if chat:
        delta = Delta(role="assistant" if role else None, content=text)
        return ChatCompletionChunk(**ids.model_dump(), **final,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])
    return CompletionResponse(**ids.model_dump(), **final, choices=[CompletionChoice(text=text or "",
                                                                                     finish_reason=finish)])


def sse(payload: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {payload.model_dump_json()}\n\n"
