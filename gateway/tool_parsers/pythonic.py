"""Pythonic tool calls (Llama 3.2 / 4's and ToolACE's format): the whole message is a Python
list of calls with literal keyword arguments, `[get_weather(city="Paris"), f(x=1)]`. Each call's
arguments become a JSON object. Mid-stream nothing is sent until the list is complete (it is
only valid Python then); a message that is not such a list is content."""

from __future__ import annotations

import ast
import json

from gateway.tool_parsers.base import Parsed, ParsedCall


def parse(text: str, final: bool) -> Parsed:
    body = text.strip()
    if not body.startswith("["):
        return Parsed(text) if final or body else Parsed()
    if not final:
        calls = _calls(body)
        return Parsed(calls=calls) if calls else Parsed()
    calls = _calls(body)
    return Parsed(calls=calls) if calls else Parsed(text)


def _calls(body: str) -> tuple[ParsedCall, ...]:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return ()
    if not isinstance(tree, ast.List) or not tree.elts:
        return ()
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return ()
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError):  # not a literal, or a literal JSON has no form for
            return ()
        if len(args) != len(node.keywords):
            return ()
        calls.append(ParsedCall(node.func.id, arguments))
    return tuple(calls)
