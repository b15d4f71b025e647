"""Function calls in a chat model's streamed output: what to speak, and which calls it made.

Tool-capable chat templates (Qwen2.5, Hermes, ...) ask for `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, yet small models often write the same JSON in a ```json fence, or bare. A
call must never be spoken, and the words before it ("Let me check.") should be spoken at once,
so the stream is split as it arrives: text is released as speech until something that may
open a call appears; from there on it is held, and parsed as calls at the end.
"""

import json
import re
from dataclasses import dataclass

CALL_OPENERS = ("<tool_call>", "```", "{", "[")
MALFORMED_CALL = re.compile(r'"name"\s*:.*"(?:arguments|parameters)"', re.DOTALL)
# A held fence or tag whose JSON is no call is spoken after all, without its markup; small models
# sometimes answer a tool's result by repeating it ({"confirmation_code": "K7Q2"}).
MARKUP = re.compile(r"</?tool_call>|```(?:json)?", re.IGNORECASE)


@dataclass
class ToolCall:
    name: str
    arguments: dict


class ToolCallSplitter:
    """Feed the whole text generated so far (`update`); speech is what may be spoken now."""

    def __init__(self):
        self._held_from: int | None = None  # where a possible call begins

    def speakable(self, text: str) -> int:
        """How much of `text` is speech for sure: up to the start of a (possible) call."""
        if self._held_from is None:
            starts = [i for opener in CALL_OPENERS if (i := text.find(opener)) >= 0]
            if starts:
                self._held_from = min(starts)
            else:
                # A partial opener at the very end ("<tool", "``") may yet become one.
                tail = max((len(p) for o in CALL_OPENERS for p in prefixes(o) if text.endswith(p)), default=0)
                return len(text) - tail
        return self._held_from

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """At the end of generation: (the rest to speak, the calls made)."""
        start = self.speakable(text)
        held = text[start:]
        calls = parse_tool_calls(held)
        if calls or MALFORMED_CALL.search(held):
            return "", calls  # a call, or one too broken to parse: never spoken
        return spoken_json(MARKUP.sub("", held)), []


def spoken_json(text: str) -> str:
    """JSON in `text` as words a voice can say: {"confirmation_code": "K7Q2"} → confirmation code K7Q2."""
    out, i = [], 0
    for start, end, value in json_spans(text):
        out.append(text[i:start] + words_of(value))
        i = end
    out.append(text[i:])
    return "".join(out)


def words_of(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {words_of(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(words_of(v) for v in value)
    return str(value)


def prefixes(opener: str) -> list[str]:
    return [opener[:i] for i in range(1, len(opener))]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every call in `text`: tagged, fenced or bare JSON objects (or lists of them) with a "name"
    and "arguments" (or "parameters"); arguments given as a JSON string are decoded."""
    calls = []
    for candidate in json_values(MARKUP.sub(" ", text)):
        for item in candidate if isinstance(candidate, list) else [candidate]:
            if not isinstance(item, dict):
                continue
            function = item.get("function") if isinstance(item.get("function"), dict) else item
            name = function.get("name")
            arguments = function.get("arguments", function.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    continue
            if isinstance(name, str) and name and isinstance(arguments, dict):
                calls.append(ToolCall(name, arguments))
    return calls


def json_values(text: str):
    """The JSON objects and arrays in `text`, in order, skipping whatever is between them."""
    return (value for _, _, value in json_spans(text))


def json_spans(text: str):
    """(start, end, value) of each JSON object or array in `text`, in order."""
    decoder = json.JSONDecoder()
    i = 0
    while i < len(text):
        starts = [j for j in (text.find("{", i), text.find("[", i)) if j >= 0]
        if not starts:
            return
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        yield start, end, value
        i = end
