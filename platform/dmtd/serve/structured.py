"""Structured outputs and tools at the gateway: ``response_format``, ``guided_regex`` / ``guided_choice`` and tool
calls become one grammar (llguidance's JSON form, checked here, before any work), and a model's reply becomes
``tool_calls``.

The replica applies the grammar's mask to the verifier's logits (``dmtd.engine.grammar``). The model's chat
template has no tool format (SmolLM2's has none), so the tools are described in the system message, and a call is
a JSON object ``{"name": ..., "arguments": {...}}``: with ``tool_choice`` ``required`` or a named function, the
grammar allows only such objects (the arguments constrained by the function's ``parameters`` schema); with
``auto``, a reply that is one is taken as the call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from dmtd.serve.errors import InvalidRequest

MAX_SCHEMA_CHARS = 1 << 15  # a schema (or all tools' parameters) serialised


def _checked(grammar: str, field: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequest(field, f"invalid: {messages[0][:300] if messages else 'rejected by the grammar engine'}")
    return grammar


def _schema_grammar(schema: dict[str, Any], field: str) -> str:
    from llguidance import LLMatcher

    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequest(field, f"too large: at most {MAX_SCHEMA_CHARS} characters serialised, got {len(text)}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(text)
    except ValueError as e:
        raise InvalidRequest(field, f"invalid: {str(e)[:300]}") from e
    return _checked(grammar, field)


def schema_text_grammar(text: str, field: str = "json_schema") -> str:
    """The grammar of a JSON schema given as JSON text (the gRPC API's ``json_schema``)."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(field, f"is not valid JSON ({e})") from e
    if not isinstance(schema, dict):
        raise InvalidRequest(field, "must be a JSON object")
    return _schema_grammar(schema, field)


def tools_forced(body: Any) -> list[Any]:
    """The tools a call must be made to (``tool_choice`` required: any; named: that one); [] when none is forced.
    A named function that is not among ``tools`` is refused, naming ``tool_choice``."""
    tools, choice = list(getattr(body, "tools", None) or []), getattr(body, "tool_choice", None)
    if choice is None or isinstance(choice, str):
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice", "'required' needs at least one tool in tools")
        return tools if choice == "required" else []
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise InvalidRequest("tool_choice", f"function {choice.function.name!r} is not in tools "
                                            f"({', '.join(t.function.name for t in tools) or 'none given'})")
    return named


def _call_schema(tool: Any) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar_for(body: Any) -> str:
    """The grammar a request's output must match ("" = free text); raises InvalidRequest naming the field."""
    fmt, regex, choice = body.response_format, body.guided_regex, body.guided_choice
    forced = tools_forced(body)
    given = [name for name, v in (("response_format", fmt is not None and fmt.type != "text"),
                                  ("guided_regex", regex is not None), ("guided_choice", choice is not None),
                                  ("tool_choice", bool(forced))) if v]
    if len(given) > 1:
        raise InvalidRequest(given[1], f"cannot be combined with {given[0]}")
    if forced:
        schemas = [_call_schema(t) for t in forced]
        return _schema_grammar(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, "tools")
    if regex is not None:
        from llguidance import LLMatcher

        return _checked(LLMatcher.grammar_from_regex(regex), "guided_regex")
    if choice is not None:
        from llguidance import LLMatcher

        alternatives = "|".join(_regex_literal(c) for c in choice)
        return _checked(LLMatcher.grammar_from_regex(f"({alternatives})"), "guided_choice")
    if fmt is None or fmt.type == "text":
        return ""
    if fmt.type == "json_object":
        return _schema_grammar({"type": "object"}, "response_format")
    if fmt.json_schema is None:
        raise InvalidRequest("response_format.json_schema", "is required when response_format.type is json_schema")
    return _schema_grammar(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text)


def chat_messages(body: Any) -> list[dict[str, str]]:
    """The chat as the template takes it: tools described in the system message (unless ``tool_choice`` is
    ``none``), earlier tool calls as their JSON, tool results as user turns."""
    out: list[dict[str, str]] = []
    for m in body.messages:
        role, text = ("system" if m.role == "developer" else m.role), m.text()
        if m.role == "tool":
            role, text = "user", (f"Result of tool call {m.tool_call_id}: {text}" if m.tool_call_id
                                  else f"Tool result: {text}")
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            text = "\n".join(filter(None, [text, *(json.dumps(c) for c in calls)]))
        out.append({"role": role, "content": text})
    tools = getattr(body, "tools", None)
    if tools and body.tool_choice != "none":
        listing = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                        "parameters": t.function.parameters or {}}) for t in tools)
        intro = ("You can call these functions:\n" + listing + "\nTo call one, reply with only a JSON object "
                 '{"name": <function name>, "arguments": <its arguments>}.')
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + intro
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_calls(body: Any, text: str) -> list[dict[str, Any]] | None:
    """The reply as ``tool_calls`` when it is a call of one of the request's tools, else None."""
    tools = {t.function.name for t in (getattr(body, "tools", None) or [])}
    if not tools or body.tool_choice == "none" or not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and obj.get("name") in tools and isinstance(obj.get("arguments"), dict)):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])}}]
