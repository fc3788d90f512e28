"""Domain errors and the one place they become gRPC status codes.

Code raises the exception that says what went wrong (``InvalidArgument("sampling.top_p ...")``,
``ResourceExhausted("queue full", retry_after_s=2)``); servicers do not pick status codes
themselves. ``status_for`` maps any exception to ``(grpc.StatusCode, message)``:

=============================================  ==========================================
exception                                      status
=============================================  ==========================================
``SplitserveError`` subclasses                 their ``code`` (the layers above define
                                               theirs: ``kvtransfer.base.TransferError`` is
                                               UNAVAILABLE, a layout mismatch FAILED_PRECONDITION)
``ValueError`` (engine validation)             INVALID_ARGUMENT
``TimeoutError`` (asyncio's too)               UNAVAILABLE (the server's own wait ran out; retry)
anything else                                  INTERNAL, generic message, logged with traceback
=============================================  ==========================================

DEADLINE_EXCEEDED is only ever the caller's own deadline (``DeadlineExceeded``): a wait
inside a server that runs out says the server is slow or stuck, which a retry may fix.

``ErrorMappingInterceptor`` applies it to every handler of a ``grpc.aio`` server, and
``http_error_for`` turns the same status into the HTTP status and OpenAI error ``type`` of the
gateway's OpenAI-compatible API (``splitserve/gateway/openai_api``), so both APIs fail alike.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import grpc

log = logging.getLogger(__name__)

__all__ = [
    "SplitserveError", "InvalidArgument", "AlreadyExists", "ResourceExhausted", "NotFound", "Cancelled",
    "DeadlineExceeded", "Unavailable", "Unauthenticated", "PermissionDenied", "status_for", "ErrorMappingInterceptor",
    "RETRY_AFTER_METADATA_KEY", "RETRY_PUSHBACK_METADATA_KEY", "INTERNAL_MESSAGE", "HttpError", "http_error_for",
]

# Trailing metadata key of a RESOURCE_EXHAUSTED status: milliseconds to wait before retrying.
RETRY_AFTER_METADATA_KEY = "retry-after-ms"
# The same in gRPC's retry design (A6): a channel's retryPolicy waits this long before retrying.
RETRY_PUSHBACK_METADATA_KEY = "grpc-retry-pushback-ms"

# What clients see for an unexpected exception; the details go to the server log only.
INTERNAL_MESSAGE = "internal server error (details are in the server log)"


class SplitserveError(Exception):
    """Base of the errors a client is meant to see; ``code`` is their gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(SplitserveError):
    """The request is malformed; retrying it unchanged will fail again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(SplitserveError):
    """The request id is taken (a request with it is running, or ended moments ago)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(SplitserveError):
    """No room now (queue full, no KV pages); retry after ``retry_after_s`` seconds if given."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None and not retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be None or >= 0, got {retry_after_s!r}")
        self.retry_after_s = retry_after_s


class NotFound(SplitserveError):
    """No such request (unknown id, or its record expired)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SplitserveError):
    """The system is not in a state that allows this (an adapter that running requests use)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Cancelled(SplitserveError):
    """The request was aborted or its client went away."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(SplitserveError):
    """The request's gRPC deadline passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(SplitserveError):
    """A worker or dependency cannot serve now (dead worker, Redis down); safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(SplitserveError):
    """The call lacks valid credentials (the bearer token of ``--auth-token``)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SplitserveError):
    """The caller is known but may not do this (a client token asking for an admin's right)."""

    code = grpc.StatusCode.PERMISSION_DENIED


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for ``exc``.

    Unexpected exceptions give INTERNAL with a generic message and are logged here with their
    traceback (so call this from the ``except`` block, or pass an exception that carries one).
    """
    if isinstance(exc, SplitserveError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"timed out inside the server{': ' if str(exc) else ''}{exc}; retry"
    log.error("unhandled %s while serving an RPC", type(exc).__name__, exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


# gRPC status -> (HTTP status, OpenAI error type), as OpenAI's and vLLM's servers answer.
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
}


@dataclass(frozen=True)
class HttpError:
    """An error as the HTTP API answers it: status, OpenAI's error body, Retry-After (seconds)."""

    status: int
    type: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def http_error_for(exc: BaseException, param: str | None = None) -> HttpError:
    """The HTTP answer to ``exc`` (through ``status_for``: the same code as over gRPC)."""
    code, message = status_for(exc)
    return dataclasses.replace(http_error_of_status(code, message), param=param,
                               retry_after_s=getattr(exc, "retry_after_s", None))


def http_error_of_status(code: grpc.StatusCode, message: str) -> HttpError:
    """The HTTP answer to a request that ended with gRPC status ``code`` (after admission)."""
    status, kind = _HTTP.get(code, (500, "internal_error"))
    return HttpError(status, kind, message)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Turn ``exc`` into the RPC's status; always raises (``context.abort`` does)."""
    code, message = status_for(exc)
    retry_after_s = getattr(exc, "retry_after_s", None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s is not None:
        ms = str(round(retry_after_s * 1000))
        # Ours for any client, and gRPC's own pushback, which a channel's retryPolicy waits for.
        context.set_trailing_metadata(((RETRY_AFTER_METADATA_KEY, ms), (RETRY_PUSHBACK_METADATA_KEY, ms)))
    await context.abort(code, message)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Server interceptor (``grpc.aio`` server) that maps raised exceptions via ``status_for``.

    Wraps every handler kind; for streaming responses an exception raised mid-stream ends the
    stream with the mapped status after the messages already sent. RESOURCE_EXHAUSTED with a
    ``retry_after_s`` also sets the trailing metadata ``retry-after-ms``. A status a handler set
    itself with ``context.abort`` (``grpc.aio.AbortError``) and the cancellation of a handler
    whose caller went away pass through untouched.
    """

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, _wrap_call),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, _wrap_stream),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, _wrap_call),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, _wrap_stream),
        )
        for attr, make, wrap in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler


def _wrap_call(behavior: Callable) -> Callable:
    @functools.wraps(behavior)
    async def wrapper(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapper


def _wrap_stream(behavior: Callable) -> Callable:
    @functools.wraps(behavior)
    async def wrapper(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapper
