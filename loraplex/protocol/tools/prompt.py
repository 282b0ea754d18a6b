"""Tools and tool messages into a chat prompt.

A chat template that renders the `tools` it is given (Hermes, Qwen, Llama 3.1, ...) gets them natively, with
assistant `tool_calls` and `tool` messages as Hugging Face templates take them. A template that does not
(SmolLM2's, many others) gets the default rendering, in plain messages it accepts:

- the tools go into the system message (added when there is none), in Hermes' words: the functions as JSON
  inside <tools></tools>, and the instruction to answer each call as
  `<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>`;
- an assistant message's tool calls become `<tool_call>` blocks in that format after its text;
- tool results become a user message of `<tool_response>` blocks (consecutive results in one message).
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.protocol.tools.parsers import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_section(tools: list[dict[str, Any]]) -> str:
    return TOOLS_SECTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict[str, Any]) -> str:
    """One assistant tool call (Hugging Face's message shape) in the default format."""
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def default_rendering(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages (Hugging Face's shape, tool calls and tool results included) as plain messages any chat
    template accepts, the tools (if any) described in the system message."""
    out: list[dict[str, Any]] = []
    after_result = False  # consecutive results share one user message
    for message in messages:
        if message["role"] == "tool":
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            after_result = True
            continue
        after_result = False
        if message.get("tool_calls"):
            parts = [message.get("content") or "", *(call_text(c) for c in message["tool_calls"])]
            out.append({"role": message["role"], "content": "\n".join(p for p in parts if p)})
        else:
            out.append(message)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def writes_json_calls(template: str | None) -> bool:
    """Llama 3.1-style templates (ipython tool role): their models call tools in bare JSON, not tags."""
    return bool(template) and "<|start_header_id|>" in template and "ipython" in template
