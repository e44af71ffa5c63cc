"""The HTTP surface of the server: the FastAPI app, the OpenAPI schema it publishes (with the
served model's limits), the OpenAI-style error bodies every failure leaves as, and the server-sent
events of one request. The deployments that use it are in pipelines/serve.py."""

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from domino.engine import Event
from domino.errors import DominoError
from domino.requests import GenerationResult
from pipelines.serving.protocol import ErrorDetail, ErrorResponse, Formatter, sse
from pipelines.serving.runner import RequestStream

logger = logging.getLogger("ray.serve")


# -- errors: every failure leaves as an OpenAI-style error body, never a stack trace ---------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.detail = status, ErrorDetail(message=message, type=type, param=param, code=code)

    def __reduce__(self):  # raised on an engine replica, re-raised by the ingress
        d = self.detail
        return ApiError, (self.status, d.message, d.type, d.param, d.code)


def model_not_served(asked: str, served: str) -> ApiError:
    """The 404 for a request or lookup naming a model this server does not serve."""
    return ApiError(404, f"the model '{asked}' is not served here; this server serves '{served}'",
                    type="not_found_error", param="model", code="model_not_found")


REFUSALS = (ApiError, DominoError)  # a client's bad request (the engine's DominoError included): a 4xx


def refused(error: Exception) -> Exception:
    """A refused request, logged in one INFO line and handed back as a value for the ingress to raise: Serve
    logs a replica method that raises as a failed call (ERROR, with the traceback), and a client's mistake is
    not the server's failure."""
    logger.info("request refused: %s", error)
    return error


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


class CancelledReceiveIsDisconnect:
    """ASGI middleware. Serve's proxy relays a request's messages through a call it cancels once the
    client has gone or the reply is sent; Starlette waits on that call for the disconnect, so without this
    the cancellation reached the error handler (an ERROR line and a traceback) instead of ending the
    request as a disconnect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}
        await self.app(scope, receive_or_disconnect, send)


api = FastAPI(title="Domino speculative decoding", description="OpenAI-compatible completions and chat completions")
api.add_middleware(CancelledReceiveIsDisconnect)
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
    """Put the served model's limits (asked of an engine replica by the ingress) into the schema."""
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
    if first["type"] == "missing" and param is None:
        message = "the request has no body: send a JSON object"
        return error_response(400, ErrorDetail(message=message, type="invalid_request_error", code="missing"))
    reason = first["msg"]
    if first["type"] == "extra_forbidden":
        reason = "not supported by this server"
    elif first["type"] == "value_error" and "error" in first.get("ctx", {}):  # our own check's words, unprefixed
        reason = str(first["ctx"]["error"])
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


@api.exception_handler(ClientDisconnect)
async def on_client_gone(request: Request, error: Exception) -> JSONResponse:
    """The client left before its request was read: nobody gets the reply, and nothing failed."""
    logger.info("the client disconnected before its request was read")
    return error_response(499, ErrorDetail(message="the client disconnected", type="invalid_request_error"))


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
    try:
        if formatter.chat:
            for index in range(len(streams)):
                yield sse(formatter.chunk(index, "", role=True))
        async for index, event in merged(streams):
            result = checked(event.result) if event.finished else None
            if event.text or event.logprobs:
                yield sse(formatter.chunk(index, event.text, event.logprobs))
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
