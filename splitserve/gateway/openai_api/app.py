"""The routes of the OpenAI-compatible API (FastAPI):

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: whole answers, or server-sent
  events with ``stream: true`` (``stream_options.include_usage`` adds a last chunk with the
  usage), ended by ``data: [DONE]``;
* ``GET /v1/models`` (the base model and the LoRA adapters the workers serve, each with its
  ``parent``; a generation names an adapter by ``model``); ``GET /health`` (200 while the gateway
  can serve, else 503);
* ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's; the admin token only);
* ``POST /tokenize`` and ``POST /detokenize`` (vLLM's bodies and answers: the gRPC ``Tokenize``
  and ``Detokenize`` behind them, with their limits); ``GET /version``.

``/v1/...``, ``/tokenize`` and ``/detokenize`` need a client token when the gateway has any
(vLLM leaves its tokenize routes open: here they spend the tokenizer threads every request
shares); ``/health`` and ``/version`` stay open.

Every request is admitted through ``GenerationServicer.admit`` -- the gRPC ``Generate``'s own
validation, limits, Redis queue and priority -- and a client that disconnects ends its request
(``Job.finish``), which aborts it on every worker. Errors are OpenAI's body
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status of
``splitserve.common.errors.http_error_for``; 429 carries ``Retry-After``. An error after a stream has
started (a worker lost past the retries) comes as one ``data: {"error": ...}`` event.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import time
from collections import defaultdict
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from splitserve.gateway.health_monitor import public_reason
from splitserve.gateway.job import Finished, cancelled
from splitserve.gateway.openai_api.protocol import (UNSUPPORTED_FIELDS, UNSUPPORTED_TOKENIZE_FIELDS,
                                                    ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    LoRAAdapterRequest, TokenizeRequest)
from splitserve.gateway.openai_api.responses import Answer, Responses, new_request_id
from splitserve.gateway.samples import SampleGroup
from splitserve.common.authz import Authorizer
from splitserve.common.errors import HttpError, NotFound, Unauthenticated, http_error_for, http_error_of_status
from splitserve.common.tracing import http_parent

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Routes outside /v1 that need a client token as /v1's do.
TOKEN_ROUTES = frozenset({"/tokenize", "/detokenize"})
try:
    VERSION = importlib.metadata.version("splitserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"


def build_app(servicer, authorizer: Authorizer | None = None, model_aliases: Sequence[str] = ()) -> FastAPI:
    """The app over ``servicer`` (a ``GenerationServicer``); ``authorizer``: the gateway's client and
    admin tokens, one of which every ``/v1`` call must carry when there are any (``/health`` stays
    open, as the gRPC health service), and whose identity owns the requests it creates (the
    token alone: the HTTP server does not see a client certificate's subject). ``model_aliases``:
    further names a request's ``model`` may give (the ``--model`` the gateway was started with)."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    authorizer = authorizer or Authorizer()
    model = servicer.model_info.model  # its public name: a local directory by its last part only
    names = {model, *model_aliases}

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if request.url.path.startswith("/v1/") or request.url.path in TOKEN_ROUTES:
            caller = authorizer.identify(request.headers.get("authorization"))
            if caller is None:
                return error_response(http_error_for(Unauthenticated(
                    "missing or wrong bearer token (header 'Authorization: Bearer <token>')")))
            request.state.caller = caller
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(HttpError(400, "invalid_request_error",
                                            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"))
        # loc: ("body", field, index or union branch, ...); the field (and an index) name the fix.
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = str(loc[0]) if loc else None
        where = param + "".join(f"[{p}]" for p in loc[1:2] if isinstance(p, int)) if param else ""
        message = f"{where}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request body")
        return error_response(HttpError(400, "invalid_request_error", message, param))

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(HttpError(exc.status_code, kind, str(exc.detail)))

    @app.get("/health")
    async def health():
        # Unauthenticated: the reason in a few fixed words; the details (Redis's error, which
        # workers are registered) are in the gateway's log, not for whoever asks.
        monitor = servicer.health
        reason = "draining" if servicer.draining else public_reason(monitor.reason if monitor is not None else "")
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        card = {"id": model, "object": "model", "created": 0, "owned_by": "splitserve",
                "max_model_len": servicer.model_info.max_model_len}
        # The LoRA adapters the workers serve, each a model of its own whose parent is the base (as vLLM lists them).
        adapters = [{**card, "id": name, "parent": model} for name in sorted(await served_loras())]
        return {"object": "list", "data": [card, *adapters]}

    async def served_loras() -> dict[str, int]:
        return await servicer.ledger.now(servicer.dispatcher.directory.loras())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoRAAdapterRequest, request: Request):
        try:
            await servicer.loras.load(body.lora_name, body.lora_path or "", request.state.caller.admin)
        except Exception as exc:
            return error_response(http_error_for(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: LoRAAdapterRequest, request: Request):
        try:
            await servicer.loras.unload(body.lora_name, request.state.caller.admin)
        except Exception as exc:
            return error_response(http_error_for(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            check_model(body.model)
            answer = await servicer.Tokenize(body.to_proto(), None)
        except Exception as exc:
            return error_response(http_error_for(exc, param=_param_of(exc)))
        return {"count": len(answer.token_ids), "max_model_len": servicer.model_info.max_model_len,
                "tokens": list(answer.token_ids), "token_strs": list(answer.tokens) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            check_model(body.model)
            answer = await servicer.Detokenize(body.to_proto(), None)
        except Exception as exc:  # the gRPC call's field is token_ids; this body's, tokens
            error = http_error_for(exc)
            return error_response(dataclasses.replace(error, message=error.message.replace("token_ids", "tokens"),
                                                      param="tokens" if error.status == 400 else None))
        return {"prompt": answer.text}

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise NotFound(f"model: the model {name!r} does not exist; this server serves {model!r}")

    async def model_or_adapter(name: str | None) -> str:
        """A generation's ``model``: the base model (""), or a LoRA adapter a worker serves (its name)."""
        if name is None or name in names:
            return ""
        adapters = await served_loras()
        if name in adapters:
            return name
        listed = ", ".join([repr(model), *map(repr, sorted(adapters))])
        raise NotFound(f"model: the model {name!r} does not exist; this server serves {listed}")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request, chat=True)

    async def generate(body, request: Request, chat: bool):
        request_id = body.request_id or new_request_id()
        try:
            generate_request = body.to_generate(request_id)
            generate_request.lora = await model_or_adapter(body.model)
            group = await servicer.admit(generate_request, remaining_s=None,
                                         owner=request.state.caller.owner, admin=request.state.caller.admin,
                                         trace_parent=http_parent(request.headers))
        except Exception as exc:  # a refused request: its error, as the gRPC API would say it
            error = http_error_for(exc, param=_param_of(exc))
            # Field paths of the gRPC request ("sampling.top_p") read as the HTTP body's ("top_p").
            return error_response(dataclasses.replace(error, message=error.message.removeprefix("sampling.")))
        responses = Responses(chat, generate_request.lora or model, servicer.tokenizer, request_id,
                              token_ids=body.return_token_ids)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_events(servicer, group, responses, usage), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await _whole(servicer, group, responses, request)

    return app


async def _whole(servicer, group: SampleGroup, responses: Responses, request: Request):
    """The answer once the request has ended; a client that disconnects first ends it."""
    async def collect():
        answers, ends = defaultdict(Answer), {}
        async for index, event in servicer.outputs(group):
            if isinstance(event, Finished):
                ends[index] = event
                continue
            answers[index].add(event)
        return [answers[i] for i in range(group.n)], ends

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():  # the client left (or this handler was cancelled)
            group.finish(cancelled("client went away"))
            collecting.cancel()
    if collecting.cancelled():  # nobody is there to read an answer
        return error_response(http_error_of_status(group.leader.outcome.status, group.leader.outcome.message))
    answers, ends = collecting.result()
    failed = next((e for e in ends.values() if e.status is not None), None)
    if failed is not None:
        return error_response(http_error_of_status(failed.status, failed.message))
    return JSONResponse(responses.whole(group, answers, [ends[i] for i in range(group.n)]))


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(servicer, group: SampleGroup, responses: Responses, usage: bool):
    """The server-sent events of a streamed request: each sample's chunks carry its ``index``,
    and its last one its finish reason. Starlette cancels this generator when the client
    disconnects: the ``finally`` then ends the request (aborting it on its workers). A client
    that stops reading is bounded like a gRPC one (``splitserve.gateway.backpressure``): each yield returns
    once the event was written, so the time spent in it is the time the client did not read,
    and a cut cancels this generator's task."""
    streams = []
    group.watch(lambda job: streams.append(servicer.backpressure.open(job, None)))

    async def bodies():
        if responses.chat:
            for index in range(group.n):
                yield _sse(responses.chunk("", [], role=True, with_usage=usage, index=index))
        async for index, event in servicer.outputs(group):
            if isinstance(event, Finished):
                if event.status is not None:  # the request failed: its error, and the stream is over
                    yield _sse(http_error_of_status(event.status, event.message).body())
                    break
                yield _sse(responses.chunk("", [], finish_reason=event.finish_reason, with_usage=usage, index=index))
            else:
                if event.text or event.reasoning or event.logprobs or (responses.token_ids and event.token_ids):
                    yield _sse(responses.chunk(event.text, event.logprobs, with_usage=usage, token_ids=event.token_ids,
                                               index=index, reasoning=event.reasoning))
                for part in event.tool_call_parts:  # a call's id and name, then its arguments as they come
                    yield _sse(responses.chunk("", [], with_usage=usage, index=index, tool_calls=[part.openai()]))
        else:
            if usage:
                yield _sse(responses.usage_chunk(group))
        yield "data: [DONE]\n\n"
    try:
        async for body in bodies():
            streams[0].sending_since = time.monotonic()
            yield body
            streams[0].sending_since = None
    finally:
        for stream in streams:
            servicer.backpressure.close(stream)
        group.finish(cancelled("client went away"))  # no effect once the request has ended


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def error_response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


# The gRPC request's field paths that an HTTP caller knows under another name.
_PARAMS = {"text": "prompt", "token_ids": "prompt", "sampling": None}


def _param_of(exc: Exception) -> str | None:
    """The request field an InvalidArgument names (its message starts with it), in OpenAI terms."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":,")
    path = first.split("[", 1)[0].split(".")
    if path and path[0] == "sampling":
        path = path[1:]
    if not path or not path[0].replace("_", "").isalnum() or path[0] not in _KNOWN_PARAMS:
        return None
    return _PARAMS.get(path[0], path[0])


_KNOWN_PARAMS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields) | frozenset(
    TokenizeRequest.model_fields) | {"text", "token_ids", *UNSUPPORTED_FIELDS, *UNSUPPORTED_TOKENIZE_FIELDS}
