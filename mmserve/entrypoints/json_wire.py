"""JSON on the wire, both ways, for every HTTP route: one parser of request bodies and one rule for the floats
JSON cannot carry.

- `loads_object`: a request body -> its JSON object. Invalid UTF-8, invalid JSON, nesting deeper than the
  parser's recursion limit and non-objects all raise ValueError naming the body, which every route answers
  with a 400 in its own API's shape.
- `json_float`: JSON has no infinity or NaN, so every response writes +/-inf as +/-FLOAT32_MAX (the largest
  finite magnitude of the float32 logits and log-probs they come from; exp() of it is still 0) and NaN as
  null. `dumps` and `WireJSONResponse` apply it to any document, `JSONFloat` to pydantic fields (the OpenAI
  models), `float_text` to one value written outside a document (a template's slot), so streamed chunks and
  whole responses agree. Binary tensor encodings (Triton's binary data extension, gRPC) carry the IEEE values
  unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import PlainSerializer

FLOAT32_MAX = 3.4028234663852886e38


def loads_object(
    data: bytes | bytearray | memoryview, what: str = "request body"
) -> dict[str, Any]:
    """The JSON object in `data`; ValueError ("malformed JSON in <what>: ...") for anything else."""
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed JSON in {what}: {exc}") from None
    except RecursionError:
        raise ValueError(f"malformed JSON in {what}: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


def json_float(value: float) -> float | None:
    """The float a JSON response carries for `value`: itself when finite, +/-FLOAT32_MAX for +/-inf, None (null)
    for NaN."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return None
    return FLOAT32_MAX if value > 0 else -FLOAT32_MAX


# a float field of a response model: serialized to JSON by the rule above
JSONFloat = Annotated[float, PlainSerializer(json_float, when_used="json")]


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


def float_text(value: float) -> str:
    """The JSON text `dumps` writes for the float `value`."""
    value = json_float(value)
    return "null" if value is None else float.__repr__(value)


def dumps_text(obj: Any, *, sort_keys: bool = False) -> str:
    """`dumps` before its UTF-8 encoding."""
    try:
        return json.dumps(
            obj, allow_nan=False, separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=False
        )
    except ValueError:  # a non-finite float somewhere: rewrite them (only then pay for the walk)
        return json.dumps(
            _finite(obj),
            allow_nan=False,
            separators=(",", ":"),
            sort_keys=sort_keys,
            ensure_ascii=False,
        )


def dumps(obj: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON of `obj` with every non-finite float written by json_float's rule."""
    return dumps_text(obj, sort_keys=sort_keys).encode("utf-8")


class WireJSONResponse(JSONResponse):
    """JSONResponse whose body follows json_float's rule instead of failing on a non-finite float."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
