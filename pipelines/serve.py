"""OpenAI-compatible serving of lossless speculative decoding on Ray Serve.

Two deployments. `EngineReplica` loads the target and the drafter once per replica and runs every
request it holds through one batched engine (domino.engine), driven by a background thread
(pipelines/serving/runner.py): every round drafts and verifies all of the replica's requests together
(continuous batching), and each may verify a different number of drafts (verify=confidence: DSpark's
scheduling); with cluster/serve.yaml it autoscales. `OpenAIServer`, the HTTP ingress, validates
requests and relays them to an engine replica and its events back, so a client whose engine replica
dies mid-stream still gets an error event, and a client that disconnects has its generation cancelled.

    serve run pipelines.serve:app                                   # the embedded target, no drafter
    serve run pipelines.serve:build_app drafter=$HOME/domino-runs/smollm2-sharegpt/step_000320/drafter num_cpus=2
    RAY_AUTH_MODE=token serve deploy cluster/serve.yaml              # a running cluster, autoscaling

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events, `n` choices as rows of the batch, and logprobs), GET /v1/models, GET /v1/models/{model}, GET /health. A request
whose row fails on the engine gets a 500 with the reason; the requests beside it go on.
"""

import asyncio
import dataclasses
import logging
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Literal

import click
import torch
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from domino.config import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE
from domino.drafter import load_drafter
from domino.engine import PREFILL_CHUNK, DecodingEngine
from domino.errors import DominoError
from domino.sampling import choice_seed
from domino.scheduler import POLICIES, POLICY_CLASSES, ThresholdVerify, make_policy
from domino.target import DEFAULT_TARGET, Target
from pipelines.serving.api import (ERRORS, SSE_CONTENT, REFUSALS, ApiError, ServedLimits, api, checked,
                                   event_stream, model_not_served, publish_limits, refused)
from pipelines.serving.metrics import ReplicaMetrics
from pipelines.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                        CompletionResponse, ErrorDetail, ErrorResponse, Formatter, GenerationRequest,
                                        ModelCard, ModelList, ResponseIds, sse)
from pipelines.serving.runner import EngineRunner, RequestStream

logger = logging.getLogger("ray.serve")


class ServeArgs(BaseModel):
    """The application's arguments (`serve run ... key=value`, or `args:` in cluster/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(DEFAULT_TARGET, description="model folder, hub id, or the embedded default")
    drafter: str = Field("none", description="drafter checkpoint folder, 'none' (plain decoding) or 'oracle'")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    block_size: int | None = Field(None, ge=2, le=MAX_BLOCK_SIZE,
                                   description=f"draft block size; a checkpoint's own by default, {DEFAULT_BLOCK_SIZE} for the oracle")
    model_name: str | None = Field(None, description="the id clients send as `model` (default: the target)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica (torch uses as many threads)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; the model runs on CUDA when > 0")
    verify: Literal[POLICIES] = Field(
        "full", description="how many drafts each request verifies per round: all of them; all of them in the "
                            "rounds where drafting beats plain decoding (gated); up to a confidence threshold; "
                            "or DSpark's confidence scheduling (the last two need a confidence head)")
    threshold: float = Field(ThresholdVerify.threshold, gt=0, lt=1, description="for verify=threshold")
    max_batch_tokens: int = Field(1024, ge=2, description="largest verify forward the start-up SPS profile "
                                                          "measures (verify=gated or confidence)")
    max_rows: int = Field(64, ge=1, description="the most choices a replica decodes together (each holds a cache "
                                                "row); more wait their turn in its queue")
    prefill_chunk: int = Field(PREFILL_CHUNK, ge=1, description="prompt tokens a waiting request prefills per engine "
                                                                "step: the batch decodes between a long prompt's chunks")

    @property
    def served_name(self) -> str:
        return self.model_name or self.target


# -- the engine replica ----------------------------------------------------------------------------

# No tokenizer spends more characters than this on one token of real text.
MAX_CHARACTERS_PER_TOKEN = 32


def check_engine(target: Target, drafter, args: ServeArgs) -> None:
    """What DecodingEngine would refuse of these arguments, asked before any weights or speed profile."""
    DecodingEngine.check(target, drafter, args.block_size, POLICY_CLASSES[args.verify], args.max_rows,
                         args.prefill_chunk)


def load_engine(args: ServeArgs) -> DecodingEngine:
    """Target, drafter and verify policy, loaded once per replica."""
    device = "cuda" if args.num_gpus > 0 else "cpu"
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    target = Target.load(args.target, device=device, dtype=dtype)
    drafter = load_drafter(args.drafter, target)
    # before the policy profiles the target's speed (checked at build time too; here for other nodes' files)
    check_engine(target, drafter, args)
    policy = make_policy(args.verify, target, threshold=args.threshold, max_tokens=args.max_batch_tokens)
    return DecodingEngine(target, drafter, block_size=args.block_size,
                          policy=policy, max_rows=args.max_rows, prefill_chunk=args.prefill_chunk)


@serve.deployment(max_ongoing_requests=32)
class EngineReplica:
    """One target + drafter and its batched engine. The ingress calls `respond` for a whole answer
    and `stream` for server-sent events; both tokenise, submit one engine row per choice and format.
    A bad request comes back as its error (`respond`'s value, `stream`'s first item), for the ingress
    to raise."""

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
        try:
            formatter, streams = await self.start(request, chat)
        except REFUSALS as error:
            return refused(error)
        try:
            results = await asyncio.gather(*(stream.result() for stream in streams))
        finally:
            for stream in streams:
                stream.cancel()  # the client left before the end, or a choice failed
        return formatter.complete([checked(result) for result in results])

    async def stream(self, request: GenerationRequest, chat: bool) -> AsyncIterator[str | Exception]:
        try:
            formatter, streams = await self.start(request, chat)
        except REFUSALS as error:
            yield refused(error)
            return
        async for event in event_stream(formatter, streams, request.include_usage):
            yield event

    async def start(self, request: GenerationRequest, chat: bool) -> tuple[Formatter, list[RequestStream]]:
        """Check and tokenise the request and submit its choices; a bad request raises here."""
        if request.model not in (None, self.model):
            raise model_not_served(request.model, self.model)
        prompt_ids = self.prompt_ids(request, chat)
        self.check_room(request, len(prompt_ids), chat)
        config = request.generation_config(len(prompt_ids), self.target.max_length)
        streams = await self.submit_choices(prompt_ids, config, request.n)
        ids = ResponseIds(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                          model=self.model)
        return Formatter(chat, ids, self.target.tokenizer), streams

    def prompt_ids(self, request: GenerationRequest, chat: bool) -> list[int]:
        if chat:
            messages = [message.as_template_input() for message in request.messages]
            if len(messages) > self.target.max_length:  # each renders at least one token, however short
                raise ApiError(400, f"the request has {len(messages)} messages, more than the target's context of "
                                    f"{self.target.max_length} tokens could hold", param="messages")
            self.check_characters(sum(len(m["content"]) for m in messages), "messages")
            return self.target.encode_prompt(messages)
        if isinstance(request.prompt, str):
            self.check_characters(len(request.prompt), "prompt")
            return self.target.encode_prompt(request.prompt, chat=False)
        vocab = self.target.vocab_size
        if not all(0 <= i < vocab for i in request.prompt):
            raise ApiError(400, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
        return request.prompt

    def check_room(self, request: GenerationRequest, prompt_tokens: int, chat: bool) -> None:
        """The prompt and the tokens asked for must fit the context: refused in the API's own terms (the
        engine would refuse too, in its own)."""
        context, room = self.target.max_length, self.target.max_length - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens but this model's context holds {context}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        asked = request.requested_max_tokens()
        if asked is not None and asked > room:
            name = request.max_tokens_field()
            raise ApiError(400, f"the prompt ({prompt_tokens} tokens) leaves room for {room} new tokens in this "
                                f"model's context of {context}; {name} asks for {asked}: lower it to {room}",
                           param=name, code="context_length_exceeded")

    def check_characters(self, characters: int, param: str) -> None:
        """Tokenising runs on the replica's event loop: text too long for the context whatever it
        tokenises to is refused before it stalls the replica's other streams."""
        if characters > MAX_CHARACTERS_PER_TOKEN * self.target.max_length:
            raise ApiError(400, f"the prompt has {characters} characters, more than the target's context of "
                                f"{self.target.max_length} tokens could hold", param=param)

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


async def unwrapped(call: Awaitable[Any]):
    """Await an engine call; a refusal it returned or an error it raised is raised here as itself (its
    handler makes the status)."""
    try:
        result = await call
    except RayTaskError as error:
        raise error.cause from None
    if isinstance(result, REFUSALS):
        raise result
    return result


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


HEALTH_WAIT_S = 5.0


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIServer:
    async def __init__(self, engine: DeploymentHandle):
        self.engine = engine
        self.streaming_engine = engine.options(stream=True)
        self.limits: ServedLimits = await unwrapped(engine.limits.remote())
        publish_limits(self.limits)
        self.created = int(time.time())

    @api.get("/health")
    async def health(self) -> dict:
        """The answer of a replica, or "busy" when every replica's request slots stayed taken for
        HEALTH_WAIT_S: the health call queues behind generations, and a probe must not hang under load
        (Serve itself restarts a replica whose engine thread stopped)."""
        try:
            return await asyncio.wait_for(unwrapped(self.engine.health.remote()), HEALTH_WAIT_S)
        except TimeoutError:
            return {"status": "busy", "model": self.limits.model, "in_flight": None}

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[self.card()])

    @api.get("/v1/models/{model:path}", responses=ERRORS)  # a path: hub ids hold a slash
    async def model(self, model: str) -> ModelCard:
        if model != self.limits.model:
            raise model_not_served(model, self.limits.model)
        return self.card()

    def card(self) -> ModelCard:
        return ModelCard(id=self.limits.model, created=self.created)

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
        chunks = self.streaming_engine.stream.remote(request, chat)
        first = await unwrapped(chunks.__anext__())  # a refused request fails here, before the status line
        return StreamingResponse(relayed(first, chunks), media_type="text/event-stream")


def check_application(args: ServeArgs) -> None:
    """The target, the drafter's checkpoint (made for that target) and the verify policy it must support,
    checked where the application is built: a replica that fails to start is retried, and Serve then goes
    on serving nothing. So the target and a checkpoint folder must lie at the same paths here and on the
    replicas' nodes. The target's weights are not loaded, only their files' headers checked (shape_only);
    the drafter is loaded as the replicas load it, on the meta device, so damaged or mismatched weights
    are refused here."""
    target = Target.shape_only(args.target)
    with warnings.catch_warnings():  # Torch warns that copying weights onto the meta device does nothing
        warnings.simplefilter("ignore", UserWarning)
        drafter = load_drafter(args.drafter, target)
    check_engine(target, drafter, args)


def application(args: ServeArgs, **engine_options) -> Application:
    """The application for `args`; `engine_options` (autoscaling, ...) override the engine replicas' defaults."""
    check_application(args)
    resources = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus}
    return OpenAIServer.bind(EngineReplica.options(ray_actor_options=resources, **engine_options).bind(args))


class BadApplication(DominoError, click.ClickException):
    """Arguments the application cannot be built from. Serve's command line is a click program, which
    prints a ClickException as one line ("Error: ...") instead of a traceback."""

    def __init__(self, message: str):
        # ValueError's __init__ comes first in the method order; click's sets the message it prints
        click.ClickException.__init__(self, message)


def build_app(args: dict[str, str]) -> Application:
    """Serve's application builder: `serve run pipelines.serve:build_app target=... drafter=...`."""
    try:
        return application(ServeArgs.model_validate(args))
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise BadApplication(f"bad application arguments ({problems}); the arguments are "
                             f"{', '.join(ServeArgs.model_fields)}") from None
    except DominoError as error:
        raise BadApplication(str(error)) from None


def __getattr__(name: str) -> Application:
    """`serve run pipelines.serve:app`: the embedded target, no drafter. Built when asked for, so that
    importing this module (every replica does, and `build_app`'s users) builds nothing."""
    if name == "app":
        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
