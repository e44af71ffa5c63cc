"""A client that leaves is not a server error. Serve's proxy relays a request's messages through a call
it cancels once the client has gone, so `receive()` raises TaskCancelledError where Starlette expects an
`http.disconnect` message; before the middleware, that reached the 500 handler (an ERROR line with a
traceback in the ingress log on about one disconnect in seven). Driven here through Starlette's own
request and streaming code with the receive callable Serve's proxy would give."""

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from pipelines.serving.api import CancelledReceiveIsDisconnect, api, on_client_gone, on_server_error


def app_like_the_ingress() -> FastAPI:
    """A streaming route and a body-reading route behind the ingress's middleware and error handlers."""
    app = FastAPI()
    app.add_middleware(CancelledReceiveIsDisconnect)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_server_error)

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(100):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/body")
    async def body(request: Request):
        return {"length": len(await request.body())}

    return app


def call(app: FastAPI, method: str, path: str) -> list[dict]:
    """The messages the app sends when the client is gone before it reads anything."""
    async def gone():
        raise TaskCancelledError()

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": [], "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    asyncio.run(app(scope, gone, send))
    return sent


def test_the_ingress_has_the_middleware():
    assert CancelledReceiveIsDisconnect in [middleware.cls for middleware in api.user_middleware]


def test_a_cancelled_receive_ends_a_stream_without_an_error(caplog):
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        sent = call(app_like_the_ingress(), "GET", "/stream")
    assert sent[0]["status"] == 200
    assert len(sent) < 50  # stopped early: the stream ended when the client left
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_cancelled_receive_before_the_body_is_a_disconnect_logged_as_info(caplog):
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        sent = call(app_like_the_ingress(), "POST", "/body")
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "the client disconnected" in caplog.text
