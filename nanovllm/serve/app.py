"""The OpenAI-compatible HTTP API (vLLM's `vllm serve`), on FastAPI: `/v1/models`,
`/v1/completions`, `/v1/chat/completions` (whole, or streamed as server-sent events ending in
`data: [DONE]`), `/v1/stats` (the engine's figures; with replicas, their totals and each one's) and
`/health` (503 naming the replicas that died).

A gate in front of every route answers before any body is read: 503 while the server stops, 401
without the API key (compared in constant time; `/health` stays open), 413 for a body declared
larger than the limit. A handler then reads the body (413 if it grows past the limit), checks it
(nanovllm/serve/protocol.py: 400 naming the field), refuses it with 503 and `Retry-After` when too
many requests wait, and hands it to the engine thread (nanovllm/serve/engine_thread.py). A chat's
template and every prompt's tokenizing run on worker threads, off the event loop and the engine
thread: a long prompt, or a refused one, delays no step. A client that goes away, streamed or not,
has its requests aborted and their KV blocks freed.
"""
import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from nanovllm.serve.engine_thread import EngineFailure, EngineThread, merge
from nanovllm.serve.protocol import (
    APIError,
    chat_request,
    completion_request,
    parse_json,
    short,
)
from nanovllm.serve.responses import DONE, Choices

log = logging.getLogger("nanovllm.serve")
ENGINE_REFUSALS = (("prompt", "prompt"), ("a prompt", "prompt"),  # message -> field
                   ("the request needs", "max_tokens"), ("the request runs", "n"),
                   ("logprobs", "logprobs"), ("top_k", "top_k"),
                   ("stop_token_ids", "stop_token_ids"))


@dataclass
class ServerState:
    """What the routes share: the engine, its thread, the limits, and whether the server stops."""
    llm: object
    engine: EngineThread  # or Replicas (nanovllm/serve/replicas.py), with the same methods
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 2 << 20
    max_waiting_requests: int = 1024
    stopping: bool = False
    num_active: int = 0       # HTTP requests inside a route now
    created: int = field(default_factory=lambda: int(time.time()))


class Gate:
    """Pure ASGI middleware: stopping, the key and the declared body size, before any route."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        headers = dict(scope["headers"])
        error = None
        if state.stopping:
            error = APIError(503, "the server is stopping", type="service_unavailable")
        elif path.startswith("/v1/") and state.api_key is not None and not authorized(
                headers.get(b"authorization", b""), state.api_key):
            error = APIError(401, "a valid API key is needed: 'Authorization: Bearer KEY'",
                             type="authentication_error")
        elif declared_length(headers) > state.max_body_bytes:
            error = too_large(state.max_body_bytes)
        if error is not None:
            return await error_response(error)(scope, receive, send)
        state.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.num_active -= 1


def authorized(header: bytes, key: str) -> bool:
    """Whether the header is 'Bearer KEY' (the scheme in any case: RFC 9110, section 11.1)."""
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), key.encode())


def declared_length(headers: dict) -> int:
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return 0  # not a number: the body is counted as it is read


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes "
                    "(--max-body-bytes)", type="request_too_large")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(APIError, lambda request, e: error_response(e))
    app.add_exception_handler(HTTPException, lambda request, e: error_response(
        APIError(e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404
                 else "invalid_request_error")))  # unknown routes and methods, in OpenAI's shape
    app.add_middleware(Gate, state=state)

    @app.get("/health")
    async def health():
        errors = state.engine.health()  # replicas that died (nanovllm/serve/replicas.py)
        if errors:
            return JSONResponse({"status": "unhealthy", "errors": errors}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "nanovllm", "max_model_len": state.llm.config.max_model_len}]}

    @app.get("/v1/stats")
    async def stats():
        return await state.engine.stats()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, state)
        req = completion_request(body)
        return await serve(request, state, req, req.prompts, "completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, state)
        req = chat_request(body, state.llm.config.max_model_len)
        prompt = await asyncio.to_thread(chat_prompt, state.llm, req.prompts[0])  # not on the loop
        return await serve(request, state, req, [prompt], "chat", "chatcmpl")
    return app


async def read_json(request: Request, state: ServerState) -> dict:
    """The body, read up to the limit (a body sent in chunks declares no length), as JSON."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > state.max_body_bytes:
                raise too_large(state.max_body_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer (the server may have hung up on it)
        raise APIError(400, "the client went away before sending the whole body") from None
    body = parse_json(b"".join(chunks))
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise APIError(400, f"'model' must be a string, not {short(body['model'])}", "model")
    if body.get("model") not in (None, state.model_name):
        raise APIError(404, f"the model {str(body['model'])[:100]!r} does not exist; this server "
                       f"serves {state.model_name!r}", "model", type="not_found_error")
    return body


def chat_prompt(llm, messages: list[dict]) -> str:
    """The conversation as text, by the tokenizer's chat template (as llm.chat does)."""
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
    try:
        return llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 (templates raise their own, e.g. roles out of order)
        raise APIError(400, f"the chat template refused the messages: {str(e)[:200]}",
                       "messages") from None


async def serve(request: Request, state: ServerState, req, prompts: list, kind: str, prefix: str):
    """Queue the prompts as engine requests, then answer whole or as a stream."""
    engine = state.engine
    if len(prompts) > state.max_waiting_requests:  # could never be let in: not worth a retry
        raise APIError(400, f"{len(prompts)} prompts are more than --max-waiting-requests="
                       f"{state.max_waiting_requests}", "prompt")
    if engine.num_waiting + engine.num_adding + len(prompts) > state.max_waiting_requests:
        raise APIError(503, f"more than {state.max_waiting_requests} requests are waiting "
                       "(--max-waiting-requests); retry later", type="service_unavailable",
                       headers={"Retry-After": "1"})
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    queue = asyncio.Queue()
    try:
        await engine.add(ids, prompts, req.params, queue)
    except (ValueError, TypeError) as e:  # the engine's input processor: a request that cannot run
        param = next((p for start, p in ENGINE_REFUSALS if str(e).startswith(start)), None)
        raise APIError(400, str(e)[:500], param) from None
    except EngineFailure as e:  # no replica serves (nanovllm/serve/replicas.py)
        raise APIError(503, str(e), type="service_unavailable") from None
    tokenizer = state.llm.tokenizer
    choices = Choices(kind, request_id, state.model_name, req.params.n, req.num_logprobs,
                      lambda t: tokenizer.decode([t]) if tokenizer else str(t))
    if req.stream:
        return StreamingResponse(stream(engine, queue, ids, choices, req.include_usage),
                                 media_type="text/event-stream")
    return await whole(request, engine, queue, ids, choices)


async def whole(request: Request, engine: EngineThread, queue: asyncio.Queue, ids: list[str],
                choices: Choices):
    """Wait for every prompt's final output (or the client leaving), then answer at once."""
    finals = {}
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while len(finals) < len(ids):
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return JSONResponse({}, status_code=499)  # nobody reads it: the client left
            out = get.result()
            if isinstance(out, EngineFailure):
                raise APIError(500, str(out), type="internal_error")
            if out.finished:
                finals[out.request_id] = out
        if any(s.finish_reason == "abort" for out in finals.values() for s in out.outputs):
            raise APIError(503, "the server stopped before this request finished",
                           type="service_unavailable")
        return choices.whole([finals[i] for i in ids])
    finally:
        gone.cancel()
        if len(finals) < len(ids):
            engine.abort([i for i in ids if i not in finals])


async def disconnected(request: Request):
    """Returns when the client disconnects (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(engine: EngineThread, queue: asyncio.Queue, ids: list[str], choices: Choices,
                 include_usage: bool):
    """Server-sent events as tokens arrive; outputs that queued up while the client was slow are
    merged into one event per choice. Cancelled when the client leaves: its requests are aborted."""
    index = {request_id: i for i, request_id in enumerate(ids)}
    unfinished = set(ids)
    try:
        while unfinished:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            merged = {}
            for out in arrived:
                if isinstance(out, Exception):
                    error = APIError(500, str(out), type="internal_error")
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                old = merged.get(out.request_id)
                merged[out.request_id] = out if old is None else merge(old, out)
            for out in merged.values():
                if out.finished:
                    unfinished.discard(out.request_id)
                for event in choices.chunks(index[out.request_id], out, include_usage):
                    yield event
        if include_usage:
            yield choices.usage_event()
        yield DONE
    finally:
        if unfinished:
            engine.abort(list(unfinished))
