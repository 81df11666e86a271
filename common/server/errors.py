"""Client errors and the one JSON shape every route uses for them.

The shape is OpenAI's, so OpenAI clients parse it, and it names the offending field:
    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": 400}}
"""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}
_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
# msgspec names an unknown or missing field in the message, and the path only up to its object.
_FIELD = re.compile(r"^Object (?:contains unknown|missing required) field `(?P<name>[^`]*)`")


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict:
        return error_body(self.message, self.param, self.status)

    def response(self) -> web.Response:
        return error_response(self.message, self.param, self.status)


def error_body(message: str, param: str | None, status: int) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, param: str | None = None, status: int = 400) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(error_body(message, param, status)),
        status=status,
        content_type="application/json",
    )


def field_path(prefix: str, msgspec_path: str) -> str:
    """`$.a[0].b` from msgspec, under `prefix` -> `prefix.a[0].b`; a dict value (`[...]`)
    is named by its dict."""
    path = msgspec_path.replace("[...]", "").lstrip(".")
    if not prefix:
        return path
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def from_validation_error(exc: msgspec.ValidationError, prefix: str = "") -> ApiError:
    text = str(exc)
    match = _PATH.search(text)
    path = match.group("path") if match is not None else ""
    message = text[: match.start()] if match is not None else text
    field = _FIELD.match(message)
    if field is not None:
        path = f"{path}.{field.group('name')}"
    if not path and not prefix:
        return ApiError(message, None)
    param = field_path(prefix, path)
    return ApiError(f"{message} (field '{param}')", param)


def convert(obj: object, type_: type, prefix: str = ""):
    """msgspec.convert with errors turned into ApiError naming the field."""
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc, prefix) from None


def decode_json(body: bytes, type_: type):
    if not body.strip():
        raise ApiError("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None


async def handle_errors(request: web.Request, handler) -> web.StreamResponse:
    """Run a handler; every error becomes a JSON answer in OpenAI's shape (an unexpected one a
    logged 500), never a traceback page. Cancellation and client resets pass through."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.reason, None, exc.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal server error", None, 500)
