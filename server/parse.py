"""Request bodies: JSON parsing and validation off the event loop, with bounded work and bounded errors.

FastAPI parses a JSON body and validates it on the event loop, and its 422 lists every error. A 1 MiB body of
100,000 unknown keys then costs seconds of pydantic work (while every other request, ``/health`` included, waits)
and a 20 MB answer. Here (``json_body(Model)``, a FastAPI dependency):

- the body is parsed (``json.loads``) and validated in a worker thread (``starlette.concurrency.run_in_threadpool``);
- pydantic sees at most ``MAX_UNKNOWN_KEYS`` of the unknown top-level keys (the others are only counted), so the
  validation errors are at most the model's fields plus that;
- a JSON integer of more than ``MAX_INT_DIGITS`` digits becomes an ``OversizedInt`` (refused by the field's type
  check, so the 422 names the field; Python's ``int`` refuses past 4300 digits, which named only ``body``).

The 422 itself (``server.app``) lists at most ``MAX_DETAIL`` errors and counts the rest.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from .schemas import MAX_INT_DIGITS, OversizedInt

MAX_UNKNOWN_KEYS = 4  # unknown top-level keys that reach pydantic (and the 422); the rest are counted
MAX_DETAIL = 8  # errors listed in a 422's ``detail``; ``detail_omitted`` counts the rest


class BodyValidationError(RequestValidationError):
    """A ``RequestValidationError`` that also counts the errors not listed (``omitted``)."""

    def __init__(self, errors, *, omitted: int = 0):
        super().__init__(errors)
        self.omitted = omitted


def _parse_int(digits: str):
    n = len(digits.lstrip("-"))
    return OversizedInt(n) if n > MAX_INT_DIGITS else int(digits)


def _json_error(message: str) -> BodyValidationError:
    return BodyValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message, "ctx": {"error": message}}])


def parse_and_validate(model: type[BaseModel], body: bytes, content_type: str | None) -> BaseModel:
    """``model`` from a JSON ``body``. Raises ``BodyValidationError`` (loc without ``body`` for fields)."""
    if content_type and "json" not in content_type.lower():
        raise BodyValidationError([{"type": "model_attributes_type", "loc": ("body",), "msg": "not JSON"}])
    try:
        data = json.loads(body, parse_int=_parse_int)
    except RecursionError:
        raise _json_error("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _json_error(str(e)[:200]) from None
    omitted = 0
    if isinstance(data, dict):
        fields = model.model_fields  # a property: read it once
        unknown = [k for k in data if k not in fields]
        if len(unknown) > MAX_UNKNOWN_KEYS:
            omitted = len(unknown) - MAX_UNKNOWN_KEYS
            drop = set(unknown[MAX_UNKNOWN_KEYS:])
            data = {k: v for k, v in data.items() if k not in drop}
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BodyValidationError(e.errors(include_url=False), omitted=omitted) from None


def json_body(model: type[BaseModel]):
    """A FastAPI dependency: the request's JSON body as ``model``, parsed and validated in a worker thread.
    Declare the body in the route's OpenAPI with ``openapi_body(model)``."""

    async def dependency(request: Request) -> BaseModel:
        body = await request.body()
        return await run_in_threadpool(parse_and_validate, model, body, request.headers.get("content-type"))

    return dependency


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route whose body comes from ``json_body(model)``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
