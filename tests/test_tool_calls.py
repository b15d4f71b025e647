"""The split of a streamed reply into speech and function calls (services/tool_calls.py)."""

from services.tool_calls import ToolCall, ToolCallSplitter, parse_tool_calls

BOOKING = ToolCall("book_table", {"name": "Garcia", "party_size": 2, "time": "19:00"})


def stream(text: str, step: int = 3) -> tuple[str, list[ToolCall]]:
    """Feed `text` as a model would stream it; return what was spoken and the calls."""
    splitter, spoken = ToolCallSplitter(), ""
    for end in range(step, len(text) + step, step):
        upto = splitter.speakable(text[:end])
        assert upto >= len(spoken), "speech, once released, is never taken back"
        spoken = text[:upto]
    rest, calls = splitter.finish(text)
    return spoken + rest, calls


def test_a_tagged_call_is_not_spoken_and_the_words_before_it_are():
    text = 'Let me book that. <tool_call>\n{"name": "book_table", "arguments": {"name": "Garcia", "party_size": 2, "time": "19:00"}}\n</tool_call>'
    assert stream(text) == ("Let me book that. ", [BOOKING])


def test_a_fenced_call_as_small_models_write_it_is_a_call_too():
    text = '```json\n{"name": "book_table", "arguments": {"name": "Garcia", "party_size": 2, "time": "19:00"}}\n```'
    assert stream(text) == ("", [BOOKING])


def test_several_calls_and_string_arguments():
    text = (
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
        '<tool_call>{"name": "time", "parameters": {"zone": "CET"}}</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("weather", {"city": "Paris"}), ToolCall("time", {"zone": "CET"})]
    assert parse_tool_calls('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]') == [
        ToolCall("a", {}),
        ToolCall("b", {}),
    ]


def test_plain_speech_is_spoken_whole_and_json_that_is_no_call_is_spoken_as_words():
    assert stream("The capital of France is Paris.") == ("The capital of France is Paris.", [])
    assert stream('The answer is ```{"value": 4}```') == ("The answer is value 4", [])
    # A call too broken to parse (Qwen2.5-Coder-0.5B wrote this) is not spoken either.
    assert stream('{"name": "end_call", "arguments": type object, properties message Goodbye!') == ("", [])
    # Qwen2.5-Coder-0.5B answered a booking's result by repeating it.
    assert stream('{"confirmation_code": "K7Q2"}') == ("confirmation code K7Q2", [])


def test_a_partial_opener_at_the_end_is_held_until_it_is_decided():
    splitter = ToolCallSplitter()
    assert splitter.speakable("Sure. <tool") == len("Sure. ")
    assert splitter.speakable("Sure. <tool_call>") == len("Sure. ")
    splitter = ToolCallSplitter()
    assert splitter.speakable("Sure. <b") == len("Sure. <b")
