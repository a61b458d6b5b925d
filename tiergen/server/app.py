"""The FastAPI application: OpenAI-compatible routes over a continuous-batching scheduler."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiergen.engine.llm import LLM, StreamEvent
from tiergen.engine.scheduler import CANCELLED, TIMED_OUT, QueueFull, Scheduler
from tiergen.errors import TiergenError
from tiergen.server.bridge import DONE, Generation, sse
from tiergen.server.endpoints import Endpoints, Prepared
from tiergen.server.errors import APIError, install_handlers
from tiergen.server.metrics import CONTENT_TYPE, ServerMetrics
from tiergen.server.protocol import StreamOptions, sampling_error

MAX_BODY_BYTES = 1 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._error().response()(scope, receive, send)
        seen = 0

        async def limited() -> Message:  # a body without Content-Length (chunked)
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._error()
            return message

        await self.app(scope, limited, send)


FAILED = (CANCELLED, TIMED_OUT, "error")  # finish reasons that answer with an error


TOKEN_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, outside /v1


class APIKey:
    """ASGI middleware: every request under /v1/, and to vLLM's token routes, must carry
    ``Authorization: Bearer <key>``; otherwise a 401 in OpenAI's error shape. /health and
    /metrics stay open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or
                                        scope["path"] in TOKEN_ROUTES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not given:
                error = APIError(401, "no API key given: send it as 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "incorrect API key", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class Server(Endpoints):
    """What the routes share: the endpoints over the model, its scheduler, the metrics and
    the server's health."""

    def __init__(self, llm: LLM, model_names: Sequence[str], max_queue: int,
                 max_running: int | None, default_max_tokens: int,
                 chat_template: str | None, queue_timeout: float | None,
                 prefix_cache: int, prefix_cache_disk: int) -> None:
        super().__init__(llm, model_names, default_max_tokens, chat_template)
        self.scheduler = Scheduler(llm, max_queue=max_queue, max_running=max_running,
                                   queue_timeout=queue_timeout, prefix_cache=prefix_cache,
                                   prefix_cache_disk=prefix_cache_disk)
        self.metrics = ServerMetrics(self.scheduler)
        self.closing = False
        self.engine_failed = False

    def check_available(self) -> None:
        if self.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine_failed:
            raise APIError(503, "the engine has failed; restart the server", code="engine_failed")

    # -- generation ------------------------------------------------------------------------
    async def generate(self, request: Request, job: Prepared) -> Response:
        """Submit every choice of every prompt; answer with a stream or with the whole result."""
        self.check_available()
        generation = Generation(self.scheduler, self.metrics.observe)
        try:
            generation.submit(*job.inputs())
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except TiergenError as e:
            raise sampling_error(e, job.param) from None
        if job.body.stream:
            options = job.body.stream_options or StreamOptions()
            # the status line waits for the first event: a request that times out in the
            # queue or is cancelled before it starts still gets its own status code
            events = generation.events()
            try:
                first = await anext(events)
            except BaseException:
                generation.cancel()
                raise
            if first[1].finish_reason in FAILED:
                generation.cancel()
                raise self._failure(first[1].finish_reason)
            return StreamingResponse(self._stream(generation, job, options, first, events),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await self._collect(request, generation, job))

    def _failure(self, finish_reason: str) -> APIError:
        if finish_reason == CANCELLED:
            return APIError(503, "the server is shutting down; the request was cancelled",
                            code="shutting_down")
        if finish_reason == TIMED_OUT:
            return APIError(503, f"the request waited in the queue longer than "
                                 f"{self.scheduler.queue_timeout:g} s (--queue-timeout); retry later",
                            code="queue_timeout")
        self.engine_failed = True
        return APIError(500, "the engine failed while generating; see the server's log",
                        code="engine_failed")

    async def _stream(self, generation: Generation, job: Prepared, options: StreamOptions,
                      first: tuple[int, StreamEvent],
                      rest: AsyncIterator[tuple[int, StreamEvent]]) -> AsyncIterator[str]:
        envelope, report, prompt_tokens = job.envelope, job.report, job.prompt_tokens

        async def events() -> AsyncIterator[tuple[int, StreamEvent]]:
            yield first
            async for item in rest:
                yield item

        generated = 0  # tokens delivered so far, every choice together
        started: set[int] = set()  # choices whose echo went out

        def usage_so_far() -> tuple[int, int] | None:
            return (prompt_tokens, generated) if options.continuous_usage_stats else None

        try:
            if envelope.chat:
                for i in range(len(generation.requests)):
                    yield sse(envelope.chunk(i, "", role="assistant", usage_so_far=usage_so_far()))
            async for choice, ev in events():
                if ev.finish_reason in FAILED:
                    yield sse(self._failure(ev.finish_reason).body())
                    return
                generated += ev.token_id >= 0
                if choice not in started:
                    started.add(choice)
                    seq = generation.requests[choice].seq
                    echo, logprobs = report.start(choice, seq.prompt_logprobs)
                    if echo or logprobs:
                        yield sse(envelope.chunk(choice, echo, usage_so_far=usage_so_far(),
                                                 logprobs=logprobs))
                logprobs = report.tokens(choice, [ev.token_id], [ev.logprobs]) \
                    if ev.logprobs is not None else None
                if ev.text or logprobs:
                    yield sse(envelope.chunk(choice, ev.text, usage_so_far=usage_so_far(),
                                             logprobs=logprobs))
                if ev.finish_reason is not None:
                    yield sse(envelope.chunk(choice, "", ev.finish_reason,
                                             usage_so_far=usage_so_far()))
            if options.include_usage:
                yield sse(envelope.usage_chunk(prompt_tokens, generation.completion_tokens))
            yield DONE
        finally:  # also when the client went away mid-stream
            generation.cancel()

    async def _collect(self, request: Request, generation: Generation, job: Prepared) -> dict:
        async def drain() -> None:
            async for _ in generation.events():
                pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        drained, watcher = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([drained, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            generation.cancel()  # nothing left to stop unless the client has gone
        if not drained.done():
            drained.cancel()
            raise APIError(499, "the client closed the connection")
        for r in generation.requests:
            if r.finish_reason in FAILED:
                raise self._failure(r.finish_reason)
        return job.response([r.seq for r in generation.requests], generation.completion_tokens)


PREFIX_CACHE_BYTES = 1 << 30  # the prompt prefixes a server keeps by default


def create_app(llm: LLM, model_names: Sequence[str] = (), *, max_queue: int = 256,
               max_running: int | None = None, default_max_tokens: int = 256,
               chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               api_key: str | None = None, queue_timeout: float | None = None,
               prefix_cache: int = PREFIX_CACHE_BYTES, prefix_cache_disk: int = 0) -> FastAPI:
    """An OpenAI-compatible app serving ``llm``.

    ``model_names``: the names clients may ask for (the first is listed by /v1/models; the
    model's own name is always accepted). ``default_max_tokens`` applies to requests that
    give none. ``api_key``: the key every /v1/ request must bear. ``queue_timeout``: seconds a
    request may wait to be admitted before it gets a 503. ``prefix_cache``: bytes of prompt
    prefixes kept for the requests that follow (0: none), and ``prefix_cache_disk`` bytes more
    in spill files for those that leave it. The scheduler starts and stops with the app's
    lifespan.
    """
    server = Server(llm, model_names, max_queue, max_running, default_max_tokens, chat_template,
                    queue_timeout, prefix_cache, prefix_cache_disk)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.closing = True
        await asyncio.to_thread(server.scheduler.stop, cancel=True)

    app = FastAPI(title="tiergen", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
    install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            server.check_available()
        except APIError as e:
            return e.response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_names[0], "object": "model", "created": 0, "owned_by": "tiergen",
             "max_model_len": llm.config.context_length}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, server.completion(await request.body()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, server.chat(await request.body()))

    # vLLM's token routes (outside /v1, as vLLM has them)
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(server.tokenize(await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(server.detokenize(await request.body()))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(server.tokenizer_info())

    return app
