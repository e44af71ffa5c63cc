"""The OpenAI-compatible wire format: pydantic models for the requests and responses of
/v1/completions and /v1/chat/completions, and the error body.

Requests are validated here, at the boundary: anything a model refuses becomes a 400 with an
OpenAI-style error body before it reaches the engine, and the published OpenAPI schema states the
same limits. Types are strict, as JSON Schema's are: "5" is not a token count and "true" is not a
flag (pydantic would coerce both); 5.0 is an integer, as JSON Schema says. All or nothing: a request
field this server does not honour (tools, penalties, ...) is refused with a 400 that names it, never
silently ignored.

Per-request statistics travel in one extension field, `metrics` (GenerationStats.as_dict(): vLLM's
`speculative_decoding` counts, tau, rounds and the time split). A complete response carries them for
all its choices together; in a stream, each choice's last chunk carries that choice's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from domino.decoding import GenerationConfig, GenerationResult
from domino.requests import GenerationStats, TokenLogprob
from domino.sampling import SamplingParams
from domino.text import TokenBytes

# Optional response fields are left out of the JSON when unset (OpenAI omits them too).
OMIT_WHEN_NONE = dict(default=None, exclude_if=lambda value: value is None)
MAX_CHOICES = 16  # n: each choice is a row of the replica's batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5
MAX_SEED = (1 << 53) - 1  # JSON numbers beyond this lose precision in many clients (and in the schema)


# -- errors ----------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str  # "invalid_request_error", "not_found_error" or "server_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- requests --------------------------------------------------------------------------------------


def utf8_encodable(text: str) -> str:
    """JSON may carry a lone surrogate (\\ud83d); no tokenizer takes it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone UTF-16 surrogate, which is not a character") from None
    return text


Text = Annotated[str, AfterValidator(utf8_encodable)]


def integral_decimals_as_ints(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer, in a list of token ids too; strict types would not. Only one
    list level is read (no field nests deeper), so a deeply nested value costs no recursion."""
    def whole(item: Any) -> Any:
        return int(item) if isinstance(item, float) and item.is_integer() else item
    return [whole(item) for item in value] if isinstance(value, list) else whole(value)


class RequestPart(BaseModel):
    """A request or a part of one: unknown fields refused, no coercion between JSON types, and null for an
    option meaning its default (OpenAI's clients send null for options left unset)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data


class StreamOptions(RequestPart):

    include_usage: bool = Field(False, description="end the stream with a chunk holding usage (and no choices)")


def given_only_with(field: str, flag: str) -> dict[str, Any]:
    """JSON Schema: when `field` is given (not null), `flag` must be true."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [flag], "properties": {flag: {"const": True}}}}


class GenerationRequest(RequestPart):
    """The fields both endpoints share: which model, how long, how to sample, when to stop."""

    # fields that mean something only with a flag on: refused without it (and the schema says so)
    NEEDS_FLAG: ClassVar[dict[str, str]] = {"stream_options": "stream"}
    # allow_inf_nan: Python's JSON reader takes NaN and Infinity, which no sampling parameter means
    model_config = ConfigDict(allow_inf_nan=False, json_schema_extra=lambda schema, cls: schema.update(
        allOf=[given_only_with(field, flag) for field, flag in cls.NEEDS_FLAG.items()]))

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: int | None = Field(None, gt=0, description="new tokens at most; the prompt plus these must fit "
                                                           "the model's context (else 400)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="extension: keep the k most likely tokens (0 turns it off)")
    stop: Text | Annotated[list[Text], Field(max_length=16)] | None = Field(
        None, description="stop strings; the text ends before them")
    seed: int | None = Field(None, ge=-MAX_SEED, le=MAX_SEED,
                             description="with verify full or threshold, the same seed gives the same tokens whatever "
                                         "else the server runs; gated and confidence weigh the whole batch, so "
                                         "there a seed's tokens may differ (their distribution stays the model's)")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, decoded side by side")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="needs stream: true")
    # sent by some OpenAI clients whatever the user asked: accepted where they change no output
    user: Text | None = Field(None, description="an end-user id: accepted, and changes no output")
    presence_penalty: Literal[0] = Field(0, description="only 0, no penalty (penalties are not supported)")
    frequency_penalty: Literal[0] = Field(0, description="only 0, no penalty (penalties are not supported)")

    @model_validator(mode="after")
    def _flags_on(self) -> "GenerationRequest":
        for field, flag in self.NEEDS_FLAG.items():
            if getattr(self, field) is not None and not getattr(self, flag):
                raise ValueError(f"{field} needs {flag}: true")
        return self

    @model_validator(mode="before")
    @classmethod
    def _as_json_schema_reads_it(cls, data: Any) -> Any:
        """5.0 is an integer."""
        return {k: integral_decimals_as_ints(v) for k, v in data.items()} if isinstance(data, dict) else data

    def generation_config(self, prompt_tokens: int, context: int) -> GenerationConfig:
        """The engine's config. Without max_tokens, the request may fill the rest of the context."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, context - prompt_tokens)  # an over-long prompt was refused before (check_room)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationConfig(max_new_tokens=max_tokens, stop_strings=stop, seed=self.seed,
                                sampling=SamplingParams(self.temperature, self.top_p, self.top_k),
                                logprobs=self.top_logprobs_wanted())

    def max_tokens_field(self) -> str:
        """The field that bounds the answer, as the client named it."""
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_field())

    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(GenerationRequest):
    prompt: (Annotated[str, Field(min_length=1), AfterValidator(utf8_encodable)]
             | Annotated[list[TokenId], Field(min_length=1)]) = Field(
        description="raw text (no chat template) or token ids (each below the model's vocabulary size)")
    max_tokens: int | None = Field(16, gt=0, description="new tokens at most (OpenAI's default: 16)")
    logprobs: int | None = Field(None, ge=0, le=5, description="each token's log-probability under the model, "
                                                               "with this many most likely alternatives")

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """OpenAI also takes a list of prompts (or of token lists), one choice each: named, not misread."""
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("several prompts in one request are not supported: send one prompt per request")
        return prompt


class TextPart(RequestPart):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestPart):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        """The {role, content} dict a chat template expects, text parts joined."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    NEEDS_FLAG = {**GenerationRequest.NEEDS_FLAG, "top_logprobs": "logprobs"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0, description="OpenAI's newer name for max_tokens")
    logprobs: bool = Field(False, description="each token's log-probability under the model")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="most likely alternatives per token (needs logprobs: true)")

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(**OMIT_WHEN_NONE)
    content: str | None = Field(**OMIT_WHEN_NONE)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ResponseBase(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = Field(**OMIT_WHEN_NONE)
    # Extension: the speculative-decoding statistics (see the module docstring).
    metrics: dict[str, Any] | None = Field(**OMIT_WHEN_NONE)


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


class ResponseIds(BaseModel):
    """What every object of one response repeats."""

    id: str
    created: int
    model: str


class Formatter:
    """Turns the engine's tokens, log-probabilities and results into one endpoint's objects."""

    def __init__(self, chat: bool, ids: ResponseIds, tokenizer):
        self.chat, self.ids, self.tokenizer = chat, ids, tokenizer
        self.token_bytes = TokenBytes(tokenizer)

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _top(self, pairs: list[tuple[int, float]]) -> list[TopLogprob]:
        return [TopLogprob(token=self.piece(t), logprob=v, bytes=list(self.token_bytes(t))) for t, v in pairs]

    def logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | CompletionLogprobs | None:
        """`entries` in the endpoint's format."""
        if entries is None:
            return None
        if self.chat:
            return ChatLogprobs(content=[
                ChatTokenLogprob(token=self.piece(e.token), logprob=e.logprob, bytes=list(self.token_bytes(e.token)),
                                 top_logprobs=self._top(e.top)) for e in entries])
        return CompletionLogprobs(tokens=[self.piece(e.token) for e in entries],
                                  token_logprobs=[e.logprob for e in entries],
                                  top_logprobs=[{self.piece(t): v for t, v in e.top} for e in entries],
                                  text_offset=[e.text_offset for e in entries])

    def complete(self, results: list[GenerationResult]) -> CompletionResponse | ChatCompletionResponse:
        """The whole reply of a request that is not streamed, one choice per result."""
        final = dict(**self.ids.model_dump(), usage=usage(results), metrics=combined_metrics(results))
        if self.chat:
            return ChatCompletionResponse(**final, choices=[
                ChatChoice(index=i, message=AssistantMessage(content=r.text or ""), logprobs=self.logprobs(r.logprobs),
                           finish_reason=r.finish_reason) for i, r in enumerate(results)])
        return CompletionResponse(**final, choices=[
            CompletionChoice(index=i, text=r.text or "", logprobs=self.logprobs(r.logprobs),
                             finish_reason=r.finish_reason) for i, r in enumerate(results)])

    def chunk(self, index: int, text: str | None, logprobs: list[TokenLogprob] | None = None,
              result: GenerationResult | None = None, role: bool = False) -> CompletionResponse | ChatCompletionChunk:
        """One streamed object for choice `index`: new text, or (with `result`) the choice's last one,
        carrying its finish reason and statistics."""
        finish = result.finish_reason if result is not None else None
        metrics = result.stats.as_dict() if result is not None else None
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=self.logprobs(logprobs), finish_reason=finish)
            return ChatCompletionChunk(**self.ids.model_dump(), metrics=metrics, choices=[choice])
        choice = CompletionChoice(index=index, text=text or "", logprobs=self.logprobs(logprobs),
                                  finish_reason=finish)
        return CompletionResponse(**self.ids.model_dump(), metrics=metrics, choices=[choice])

    def usage_chunk(self, results: list[GenerationResult]) -> CompletionResponse | ChatCompletionChunk:
        """The last object of a stream that asked for usage: no choices."""
        final = dict(**self.ids.model_dump(), usage=usage(results), metrics=combined_metrics(results), choices=[])
        return ChatCompletionChunk(**final) if self.chat else CompletionResponse(**final)


def usage(results: list[GenerationResult]) -> Usage:
    prompt, completion = results[0].stats.prompt_tokens, sum(len(r.tokens) for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def combined_metrics(results: list[GenerationResult]) -> dict[str, Any]:
    return GenerationStats.combined([r.stats for r in results]).as_dict()


def sse(payload: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {payload.model_dump_json()}\n\n"
