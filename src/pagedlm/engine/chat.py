"""Chat messages rendered into a prompt with the model's chat template (tool calls included)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedlm.engine.errors import ChatTemplateError
from pagedlm.sampling.params import MAX_JSON_DEPTH, JSONDepthError, loads_json, within_depth

if TYPE_CHECKING:
    from pagedlm.hub.tokenizer import Tokenizer


def render_chat(tokenizer: Tokenizer, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, chat_template: str | None = None,
                template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False) -> str:
    """The prompt text of a conversation (OpenAI-shaped messages: role, content, and optionally name,
    tool_call_id, tool_calls). Assistant tool calls are rendered by the template where it knows them (its
    `tool_calls`), else as Hermes-style text in the turn's content. `chat_template` replaces the model's own for
    this call; `template_kwargs` are more template variables (e.g. enable_thinking); `continue_final_message`:
    the prompt ends with the last message's text, its turn left open for the model to continue (a prefill; without
    a generation prompt). Raises ChatTemplateError. The one place the chat template is applied (the server,
    `LLM.chat`)."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true.")
    knows_calls = "tool_calls" in (chat_template or tokenizer.hf.chat_template or "")
    msgs = [_template_message(m, knows_calls) for m in messages]
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                                             chat_template=chat_template,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - no template, or the template rejected the messages
        raise ChatTemplateError(f"Cannot apply the chat template: {e}") from None


def _template_message(m: Mapping[str, Any], knows_calls: bool) -> dict[str, Any]:
    msg = dict(m)
    calls = msg.pop("tool_calls", None)
    if not calls:
        return msg
    calls = [{"id": c.get("id"), "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _json_arguments(c["function"]["arguments"])}}
             for c in calls]
    if knows_calls:
        msg["tool_calls"] = calls
    else:
        msg["content"] = (msg.get("content") or "") + "".join(
            f'\n<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>' for c in calls)
    return msg


def _json_arguments(arguments: str | dict) -> dict | str:
    """A tool call's arguments as an object (templates write it with tojson), or the text if it is not JSON.
    ChatTemplateError if they are nested more than MAX_JSON_DEPTH levels deep."""
    name = "tool_calls[].function.arguments"
    try:
        if isinstance(arguments, dict):
            if not within_depth(arguments):
                raise JSONDepthError(f"{name} is nested more than {MAX_JSON_DEPTH} levels deep.")
            return arguments
        value = loads_json(arguments, name)
    except JSONDepthError as e:
        raise ChatTemplateError(str(e)) from None
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
