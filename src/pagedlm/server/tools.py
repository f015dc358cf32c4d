"""Tool calling: a built-in tool-aware chat template, tool-call parsers (per model family) and the constraint that
enforces `tool_choice: "required"` or a named function.

Hermes format (Qwen 2.5, Hermes, and the built-in template): the model writes each call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedlm.sampling.params import StructuredOutputsParams

# ChatML with tools in the system turn, assistant tool calls as <tool_call> blocks, tool results as <tool_response>
# blocks in a user turn; without tools it renders exactly as SmolLM2's own template.
HERMES_CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system = default_system -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{{ '<|im_start|>system\\n' + system }}"
    "{%- if tools -%}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -}}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
BUILTIN_TEMPLATES = {"hermes": HERMES_CHAT_TEMPLATE}
MAX_PARALLEL_CALLS = 8  # calls one constrained (required / named) answer may hold


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


class HermesToolParser:
    """`<tool_call>{json}</tool_call>` blocks; text outside them is the message content."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls): the text outside the calls' blocks, stripped, and the calls (`find_calls`)."""
        found = self.find_calls(text)
        content = outside(text, [(a, b) for a, b, _ in found]).strip()
        return (content or None), [c for _, _, c in found]

    def find_calls(self, text: str) -> list[tuple[int, int, ParsedToolCall]]:
        """Each call's block as (start, end, call); a block that is not a {"name", "arguments"} object (one cut
        short, too) is no call: it stays in the content. A block runs from `<tool_call>` to the next `</tool_call>`
        or the end of the text; its body is stripped of blanks. Linear time (a regex with a lazy body and blanks
        around it retries them at every position)."""
        found, at = [], 0
        while (first := text.find(self.start, at)) >= 0:
            body = first + len(self.start)
            close = text.find(self.end, body)
            at = len(text) if close < 0 else close + len(self.end)
            if (call := _call(text[body:len(text) if close < 0 else close].strip())) is not None:
                found.append((first, at, call))
        return found

    def call_grammar(self, functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        """A Lark grammar (with llguidance's %json) admitting only well-formed calls of `functions`."""
        options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                     "arguments": f.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                           "item_separator": ", "}}
        more = f'("\\n" tc){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return StructuredOutputsParams(grammar=f'start: tc {more}\ntc: "<tool_call>\\n" call "\\n</tool_call>"\n'
                                               f"call: %json {json.dumps(schema)}\n")


def outside(text: str, spans: list[tuple[int, int]], start: int = 0) -> str:
    """The text from `start` on outside the sorted, disjoint `spans` (start, end)."""
    kept, pos = [], start
    for a, b in spans:
        kept.append(text[pos:max(pos, a)])
        pos = max(pos, b)
    kept.append(text[pos:])
    return "".join(kept)


def _call(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's recursion limit
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


TOOL_PARSERS = {"hermes": HermesToolParser}
_KNOWS_TOOLS = re.compile(r"\btools\b")


@dataclass
class ToolSupport:
    """How a model serves `tools`: the parser of its calls, and the template requests with tools are rendered
    with (None: the model's own)."""

    parser: HermesToolParser
    template: str | None
    summary: str  # for the start-up log


def tool_support(chat_template: str | None, parser: str | None = None) -> ToolSupport:
    """Tools for a model whose chat template is `chat_template`. `parser` (--tool-call-parser) or, if None, the one
    whose call markers the template writes (Hermes if none matches). A template that knows no `tools` gets the
    built-in Hermes template for requests with tools, so that `tools` work on every model without flags
    (tool_choice "required" and named functions are enforced by the parser's call grammar whatever the model)."""
    template = chat_template or ""
    name = parser or next((n for n, cls in TOOL_PARSERS.items() if cls.start in template), "hermes")
    if _KNOWS_TOOLS.search(template):
        return ToolSupport(TOOL_PARSERS[name](), None, f"tool calls parsed as {name}")
    return ToolSupport(TOOL_PARSERS[name](), HERMES_CHAT_TEMPLATE,
                       f"its chat template knows no tools: requests with tools use the built-in hermes template, "
                       f"tool calls parsed as {name}")
