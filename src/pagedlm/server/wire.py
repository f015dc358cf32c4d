"""JSON in and out: a request body parsed into its schema (400 naming the field), a model or an APIError as the
response."""
from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pagedlm.server.api_errors import error_body
from pagedlm.server.protocol import APIError

if TYPE_CHECKING:
    from pagedlm.server.stages import StagePools

T = TypeVar("T", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # union members in pydantic error paths


async def parse_request(request: Request, model: type[T], stages: StagePools) -> T:
    """The body as `model`, parsed on the `parse` stage's threads; 400 naming the field."""
    body = await request.body()
    try:
        return await stages.run("parse", model.model_validate_json, body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        if err["type"] == "json_invalid":
            raise APIError(400, f"The request body is not valid JSON: {err['msg']}") from None
        where = ".".join(x for x in loc if x not in _TYPE_TAGS and "[" not in x) or "body"
        raise APIError(400, f"Invalid value for `{where}`: {err['msg']}", param=loc[0] if loc else None) from None


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def error_response(e: APIError, path: str = "") -> Response:
    """`e` as a response in the shape of the API serving `path` (api_errors.py; default OpenAI's)."""
    return JSONResponse(error_body(e, path), status_code=e.status, headers=e.headers)


def header_text(text: str, limit: int = 512) -> str:
    """`text` as a response header's value: printable ASCII (others become `?`), at most `limit` characters, no
    space at either end (HTTP forbids it: the response could not be sent)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit].strip(" ")
