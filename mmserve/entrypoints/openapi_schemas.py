"""What /openapi.json says about the POST routes that read their own bodies: the pieces both APIs' route
descriptions use (`openai/openapi.py`, `triton/openapi.py`).

The OpenAI, tokenizer and Triton routes parse and check their request bodies themselves (`parse_body`,
`triton/http_requests.py`) so that their 400s name the parameter in their API's error shape; FastAPI therefore
sees no body parameter and publishes no `requestBody`. The route decorators' keyword arguments (`openapi_extra`
with the request body, `responses` with the 200 and error shapes) describe them without changing how a body is
parsed or validated. The schemas describe what the routes accept; values the schema allows may still be refused
by the route's own checks (a 400), e.g. `max_tokens` of 0 or an unknown model.
"""

from __future__ import annotations

from typing import Any

JsonSchema = dict[str, Any]

JSON = "application/json"
SSE = "text/event-stream"


def inline_defs(schema: JsonSchema) -> JsonSchema:
    """A pydantic model's JSON schema with each `#/$defs/...` ref replaced by the definition itself (refs that
    point into the model's own `$defs` would not resolve inside an OpenAPI document). Discriminator mappings,
    which name the refs, are dropped: the `const` of each variant's tag still tells them apart."""
    defs = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(x, seen) for x in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"recursive model {name} cannot be inlined")
            target = resolve(defs[name], (*seen, name))
            return {**target, **{k: resolve(v, seen) for k, v in node.items() if k != "$ref"}}
        return {
            k: resolve(v, seen)
            for k, v in node.items()
            if k != "$defs" and not _is_discriminator(k, v)
        }

    return resolve(schema, ())


def _is_discriminator(key: str, value: Any) -> bool:
    return key == "discriminator" and isinstance(value, dict) and "propertyName" in value


def request_body(schema: JsonSchema, required: bool = True) -> JsonSchema:
    """An OpenAPI `requestBody` of one JSON schema."""
    return {"required": required, "content": {JSON: {"schema": schema}}}
