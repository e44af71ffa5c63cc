"""OpenAI-compatible serving of lossless speculative decoding on Ray Serve.

Two deployments. `EngineReplica` loads the target and the drafter once per replica and runs every
request it holds through one batched engine (domino.engine), driven by a background thread
(pipelines/serving/runner.py): every round drafts and verifies all of the replica's requests together
(continuous batching), and each may verify a different number of drafts (verify=confidence: DSpark's
scheduling); it autoscales. `OpenAIServer`, the HTTP ingress, validates requests and relays them to an
engine replica and its events back, so a client whose engine replica dies mid-stream still gets an
error event, and a client that disconnects has its generation cancelled.

    serve run pipelines.serve:app                                   # the embedded target, no drafter
    serve run pipelines.serve:build_app drafter=$HOME/domino-runs/smollm2-sharegpt/step_000400/drafter num_cpus=2
    serve deploy cluster/serve.yaml                                  # a running cluster, autoscaling

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events, `n` choices as rows of the batch, and logprobs), GET /v1/models, GET /health. A request
whose row fails on the engine gets a 500 with the reason; the requests beside it go on.
"""

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator
from starlette.exceptions import HTTPException

from domino.config import MAX_BLOCK_SIZE
from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.engine import Event
from domino.errors import DominoError
from domino.requests import GenerationResult
from domino.sampling import choice_seed
from domino.scheduler import POLICIES, make_policy
from domino.target import DEFAULT_TARGET, Target
from pipelines.serving.metrics import ReplicaMetrics
from pipelines.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionRequest, CompletionResponse, ErrorDetail, ErrorResponse, Formatter,
                                        GenerationRequest, ModelCard, ModelList, ResponseIds, sse)
from pipelines.serving.runner import EngineRunner, RequestStream

logger = logging.getLogger("ray.serve")


class ServeArgs(BaseModel):
    """The application's arguments (`serve run ... key=value`, or `args:` in cluster/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(DEFAULT_TARGET, description="model folder, hub id, or the embedded default")
    drafter: str = Field("none", description="drafter checkpoint folder, 'none' (plain decoding) or 'oracle'")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    block_size: int | None = Field(None, ge=2, le=MAX_BLOCK_SIZE,
                                   description="draft block size; a checkpoint's own by default, 16 for the oracle")
    model_name: str | None = Field(None, description="the id clients send as `model` (default: the target)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica (torch uses as many threads)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; the model runs on CUDA when > 0")
    verify: Literal[POLICIES] = Field(
        "full", description="how many drafts each request verifies per round: all of them; all of them in the "
                            "rounds where drafting beats plain decoding (gated); up to a confidence threshold; "
                            "or DSpark's confidence scheduling (the last two need a confidence head)")
    threshold: float = Field(0.3, gt=0, lt=1, description="for verify=threshold")
    max_batch_tokens: int = Field(1024, ge=1, description="largest verify forward the start-up SPS profile "
                                                          "measures (verify=gated or confidence)")

    @property
    def served_name(self) -> str:
        return self.model_name or self.target


# -- errors: every failure leaves as an OpenAI-style error body, never a stack trace ---------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.detail = status, ErrorDetail(message=message, type=type, param=param, code=code)

    def __reduce__(self):  # raised on an engine replica, re-raised by the ingress
        d = self.detail
        return ApiError, (self.status, d.message, d.type, d.param, d.code)


class GenerationFailed(Exception):
    """A request's row failed on the engine (the others in its batch went on)."""


def checked(result: GenerationResult) -> GenerationResult:
    if result.error is not None:
        raise GenerationFailed(result.error)
    return result


def server_error(error: Exception) -> ErrorDetail:
    message = str(error) if isinstance(error, GenerationFailed) else f"internal error ({type(error).__name__})"
    return ErrorDetail(message=message, type="server_error")


def error_response(status: int, detail: ErrorDetail) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)


api = FastAPI(title="Domino speculative decoding", description="OpenAI-compatible completions and chat completions")
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request: the message and `param` name what to fix"},
    404: {"model": ErrorResponse, "description": "the model is not served here"},
    500: {"model": ErrorResponse, "description": "the generation failed on the replica"},
}


# With stream: true, each server-sent event's `data` is one JSON object (or the final [DONE]).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
SSE_CONTENT = {"text/event-stream": {"schema": SSE_EVENT}}


@dataclass(frozen=True)
class ServedLimits:
    """What the replica's model adds to the request schema: its name, vocabulary and context."""

    model: str
    vocab_size: int
    context: int

    def apply(self, schemas: dict[str, Any]) -> None:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            fields = schemas[name]["properties"]
            fields["model"]["anyOf"][0]["enum"] = [self.model]
            for field in ("max_tokens", "max_completion_tokens"):
                if field in fields:
                    fields[field]["anyOf"][0]["maximum"] = self.context - 1
        token_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]
        token_ids["items"]["maximum"] = self.vocab_size - 1


def openapi_schema() -> dict[str, Any]:
    """FastAPI's schema, less the 422 responses it adds to every route (validation errors are 400s
    here), with the served model's limits (set by the replica)."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version="1.0.0", description=api.description, routes=api.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        limits: ServedLimits | None = getattr(api.state, "limits", None)
        if limits is not None:
            limits.apply(schema["components"]["schemas"])
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = openapi_schema


def publish_limits(limits: ServedLimits) -> None:
    """Put the served model's limits into the schema. A module function, so that the replica (whose
    class Serve ships by value, with copies of the globals it names) reaches the module's own app."""
    api.state.limits = limits
    api.openapi_schema = None


@api.exception_handler(ApiError)
async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error.status, error.detail)


@api.exception_handler(DominoError)
async def on_domino_error(request: Request, error: DominoError) -> JSONResponse:
    return error_response(400, ErrorDetail(message=str(error), type="invalid_request_error"))


UNION_TAG = re.compile(r"^(str|int|float|bool|.*[\[\-].*)$")  # pydantic names a union's members in `loc`


def most_relevant(errors: list[dict]) -> dict:
    """The error to report: for a union field, the member the value was meant for (a value of the
    wrong type for the other members fails them with *_type errors), and the deepest of those."""
    return max(errors, key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))


@api.exception_handler(RequestValidationError)
async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = most_relevant(error.errors())
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return error_response(400, ErrorDetail(message=message, type="invalid_request_error", code="json_invalid"))
    where = [str(part) for part in first["loc"] if part != "body" and not UNION_TAG.match(str(part))]
    param = ".".join(where) or None
    reason = "not supported by this server" if first["type"] == "extra_forbidden" else first["msg"]
    message = f"{param}: {reason}" if param else reason
    return error_response(400, ErrorDetail(message=message, type="invalid_request_error", param=param,
                                           code=first["type"]))


@api.exception_handler(HTTPException)
async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(error.status_code, ErrorDetail(message=str(error.detail), type=kind))


@api.exception_handler(GenerationFailed)
async def on_generation_failed(request: Request, error: Exception) -> JSONResponse:
    return error_response(500, server_error(error))


@api.exception_handler(Exception)
async def on_server_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("request failed")
    return error_response(500, ErrorDetail(message=f"internal error ({type(error).__name__}); see the replica log",
                                           type="server_error"))


# -- streaming -------------------------------------------------------------------------------------


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Event]]:
    """The events of a request's choices as they come, each with its choice's index."""
    queue: asyncio.Queue[tuple[int, Event] | Exception | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
            await queue.put(None)
        except Exception as error:
            await queue.put(error)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def event_stream(formatter: Formatter, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events for one request; closing it (the client left) cancels the generation."""
    results: list[GenerationResult | None] = [None] * len(streams)
    offsets = [0] * len(streams)  # text sent so far per choice (completions' text_offset)
    try:
        if formatter.chat:
            for index in range(len(streams)):
                yield sse(formatter.chunk(index, "", role=True))
        async for index, event in merged(streams):
            result = checked(event.result) if event.finished else None
            if event.text or event.logprobs:
                yield sse(formatter.chunk(index, event.text, event.logprobs, offsets[index]))
                offsets[index] += len(event.text)
            if result is not None:
                results[index] = result
                yield sse(formatter.chunk(index, None, result=result))
        if include_usage:
            yield sse(formatter.usage_chunk(results))
        yield "data: [DONE]\n\n"
    except Exception as error:  # the engine failed mid-stream: the status line is already sent
        logger.exception("streaming request failed")
        yield sse(ErrorResponse(error=server_error(error)))
    finally:
        for stream in streams:
            stream.cancel()


# -- the engine replica ----------------------------------------------------------------------------


def load_engine(args: ServeArgs) -> DecodingEngine:
    """Target, drafter and verify policy, loaded once per replica."""
    device = "cuda" if args.num_gpus > 0 else "cpu"
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    target = Target.load(args.target, device=device, dtype=dtype)
    drafter = args.drafter if args.drafter in ("none", "oracle") else Drafter.from_pretrained(args.drafter, target)
    if isinstance(drafter, Drafter):
        drafter = drafter.to(target.model.dtype)
    policy = make_policy(args.verify, target, threshold=args.threshold, max_tokens=args.max_batch_tokens)
    return DecodingEngine(target, None if drafter == "none" else drafter, block_size=args.block_size,
                          policy=policy)


@serve.deployment(max_ongoing_requests=32)
class EngineReplica:
    """One target + drafter and its batched engine. The ingress calls `respond` for a whole answer
    and `stream` for server-sent events; both tokenise, submit one engine row per choice and format."""

    def __init__(self, args: ServeArgs):
        torch.set_num_threads(max(1, int(args.num_cpus)))
        engine = load_engine(args)
        self.target = engine.target
        self.model = args.served_name
        self.runner = EngineRunner(engine, ReplicaMetrics(self.model))

    def check_health(self) -> None:
        """Serve restarts a replica whose engine thread has died."""
        if not self.runner.alive:
            raise RuntimeError("the engine thread has stopped")

    def limits(self) -> ServedLimits:
        return ServedLimits(self.model, self.target.vocab_size, self.target.max_length)

    def health(self) -> dict:
        self.check_health()
        return {"status": "ok", "model": self.model, "in_flight": self.runner.in_flight}

    async def respond(self, request: GenerationRequest, chat: bool):
        formatter, streams = await self.start(request, chat)
        try:
            results = await asyncio.gather(*(stream.result() for stream in streams))
        finally:
            for stream in streams:
                stream.cancel()  # the client left before the end, or a choice failed
        return formatter.complete([checked(result) for result in results])

    async def stream(self, request: GenerationRequest, chat: bool) -> AsyncIterator[str]:
        formatter, streams = await self.start(request, chat)
        async for event in event_stream(formatter, streams, request.include_usage):
            yield event

    async def start(self, request: GenerationRequest, chat: bool) -> tuple[Formatter, list[RequestStream]]:
        """Check and tokenise the request and submit its choices; a bad request raises here."""
        if request.model not in (None, self.model):
            raise ApiError(404, f"the model '{request.model}' is not served here; this server serves '{self.model}'",
                           type="not_found_error", param="model", code="model_not_found")
        prompt_ids = self.prompt_ids(request, chat)
        config = request.generation_config(len(prompt_ids), self.target.max_length)
        streams = await self.submit_choices(prompt_ids, config, request.n)
        ids = ResponseIds(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                          model=self.model)
        return Formatter(chat, ids, self.target.tokenizer), streams

    def prompt_ids(self, request: GenerationRequest, chat: bool) -> list[int]:
        if chat:
            return self.target.encode_prompt([message.as_template_input() for message in request.messages])
        if isinstance(request.prompt, str):
            return self.target.encode_prompt(request.prompt, chat=False)
        vocab = self.target.vocab_size
        if not all(0 <= i < vocab for i in request.prompt):
            raise ApiError(400, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
        return request.prompt

    async def submit_choices(self, prompt_ids: list[int], config, n: int) -> list[RequestStream]:
        """One engine row per choice, each with its own seed; a refusal cancels the choices submitted."""
        configs = [config if config.seed is None else dataclasses.replace(config, seed=choice_seed(config.seed, i))
                   for i in range(n)]
        submitted = await asyncio.gather(*(self.runner.submit(prompt_ids, c) for c in configs),
                                         return_exceptions=True)
        refusals = [s for s in submitted if isinstance(s, BaseException)]
        if refusals:
            for stream in submitted:
                if isinstance(stream, RequestStream):
                    stream.cancel()
            raise refusals[0]
        return submitted


# -- the HTTP ingress --------------------------------------------------------------------------------


async def unwrapped(call: DeploymentResponse | Any):
    """Await an engine call; an error it raised comes back as itself (its handler makes the status)."""
    try:
        return await call
    except RayTaskError as error:
        raise error.cause from None


async def relayed(first: str, chunks: DeploymentResponseGenerator) -> AsyncIterator[str]:
    """The engine's events as they come. If its replica dies mid-stream, the status line is sent
    already: the client gets an error event instead of a broken connection."""
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except Exception as error:
        logger.warning("an engine replica failed mid-stream: %s", type(error).__name__)
        yield sse(ErrorResponse(error=ErrorDetail(
            message=f"the engine replica failed mid-stream ({type(error).__name__}); retry the request",
            type="server_error")))
    finally:
        chunks.cancel()  # the client left (or the stream ended): stop the generation


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIServer:
    async def __init__(self, engine: DeploymentHandle):
        self.engine = engine
        self.limits: ServedLimits = await unwrapped(engine.limits.remote())
        publish_limits(self.limits)
        self.created = int(time.time())

    @api.get("/health")
    async def health(self) -> dict:
        return await unwrapped(self.engine.health.remote())

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.limits.model, created=self.created)])

    @api.post("/v1/completions", response_model=CompletionResponse, responses={
        **ERRORS, 200: {"content": SSE_CONTENT,
                        "description": "the completion, or with stream: true its chunks as server-sent events "
                                       "(CompletionResponse objects, then [DONE])"}})
    async def completions(self, request: CompletionRequest):
        return await self.relay(request, chat=False)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
        **ERRORS, 200: {"content": SSE_CONTENT,
                        "description": "the chat completion, or with stream: true its chunks as server-sent "
                                       "events (ChatCompletionChunk objects, then [DONE])"}})
    async def chat_completions(self, request: ChatCompletionRequest):
        return await self.relay(request, chat=True)

    async def relay(self, request: GenerationRequest, chat: bool):
        if not request.stream:
            return await unwrapped(self.engine.respond.remote(request, chat))
        chunks = self.engine.options(stream=True).stream.remote(request, chat)
        first = await unwrapped(chunks.__anext__())  # a refused request fails here, before the status line
        return StreamingResponse(relayed(first, chunks), media_type="text/event-stream")


def application(args: ServeArgs, **engine_options) -> Application:
    """The application for `args`; `engine_options` (autoscaling, ...) override the engine replicas' defaults."""
    resources = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus}
    return OpenAIServer.bind(EngineReplica.options(ray_actor_options=resources, **engine_options).bind(args))


def build_app(args: dict[str, str]) -> Application:
    """Serve's application builder: `serve run pipelines.serve:build_app target=... drafter=...`."""
    try:
        return application(ServeArgs.model_validate(args))
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise DominoError(f"bad application arguments ({problems}); the arguments are "
                          f"{', '.join(ServeArgs.model_fields)}") from None


app = build_app({})
