"""The tool-call and reasoning parsers on outputs written the way each model family writes them:
whole, streamed a character at a time and in uneven pieces (the same result every way), and
malformed ones (their text comes back as content, never an error)."""
import json
import random

import jsonschema
import pytest

from splitserve.common.errors import InvalidArgument
from splitserve.engine.grammar import check_grammar
from splitserve.engine.structured_output import StructuredOutput
from splitserve.gateway.chat_output.reasoning import PARSERS as REASONING, ReasoningMarkers, held_back
from splitserve.gateway.chat_output.stream import ChatOutput, NamedCall, ToolStream
from splitserve.gateway.chat_output.tool_parsers import PARSERS, RequiredCalls
from splitserve.gateway.chat_output.tools import (Function, ToolChoice, constraint_schema, functions_of,
                                                  resolve_tool_choice)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}}}}]
FUNCTIONS = functions_of(TOOLS)
PARIS = ("get_weather", {"city": "Paris", "days": 3})
ROME = ("search", {"query": "Rome \"old\" town"})

# (parser, output as the family writes it, the content, the calls (name, arguments)).
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "", [PARIS]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
               '\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "Rome \\"old\\" town"}}\n'
               '</tool_call>', "Let me look that up.\n", [PARIS, ROME]),
    # The stop token cut the closing tag off.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "", [PARIS]),
    # Arguments written as JSON text (some fine-tunes do).
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}'
               '</tool_call>', "", [PARIS]),
    ("qwen3_xml", '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
                  '</parameter>\n</function>\n</tool_call>', "", [PARIS]),
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n'
                    '<parameter=query>\nRome "old" town\n</parameter>\n</function>\n</tool_call>',
     "Checking.\n", [PARIS, ROME]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "search", "parameters": {"query": "Rome \\"old\\" town"}}', "", [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "search", "arguments": {"query": "Rome \\"old\\" town"}}]', "", [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]search[ARGS]'
                '{"query": "Rome \\"old\\" town"}', "", [PARIS, ROME]),
    ("pythonic", '[get_weather(city="Paris", days=3), search(query=\'Rome "old" town\')]', "", [PARIS, ROME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "", [PARIS]),
    ("pythonic", '[get_weather(city="Paris", days=3)', "", [PARIS]),  # the stop token cut the "]" off
    # Nested values, a tuple, JSON's literals, escapes, a comma and brackets inside strings.
    ("pythonic", "[get_weather(city='Pa\\'ris, (x]', days=[3, {\"k\": (1, None)}], metric=true), search()]", "",
     [("get_weather", {"city": "Pa'ris, (x]", "days": [3, {"k": [1, None]}], "metric": True}), ("search", {})]),
]

# Outputs a parser must give back as text: no call, or a call that does not parse.
MALFORMED = [
    ("hermes", "The weather is fine; no <tool_call> needed, < and > are fine too."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),
    ("llama3_json", 'Sure: {"name": "get_weather"} is what I would call.'),  # not at the start: text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": }]"),
    ("pythonic", "[get_weather(city=Paris)]"),  # a name, not a literal
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[" * 5000 + "]" * 5000),  # hostile nesting: no RecursionError escapes
    ("pythonic", "[get_weather(city='Paris').upper()]"),  # not a call of literals
    ("pythonic", '[get_weather(city="Paris", city="Rome")]'),  # a keyword twice
]


def pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 4)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def run(output: ChatOutput, text: str, how: str, parts: list | None = None):
    """(content, reasoning, whole calls) of ``text`` fed in pieces; ``parts``: gets the calls' parts."""
    content, reasoning, calls = "", "", []
    for piece in pieces(text, how):
        delta = output.feed(piece)
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.tool_calls
        if parts is not None:
            parts += delta.tool_call_parts
    delta = output.finish()
    if parts is not None:
        parts += delta.tool_call_parts
    return content + delta.content, reasoning + delta.reasoning, calls + delta.tool_calls


def joined(parts) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from its parts, as an OpenAI client joins them; each call's
    first part has its id and name and no arguments, the others no id and no name."""
    calls: dict[int, list] = {}
    for part in parts:
        if part.index not in calls:
            assert part.id and part.name and part.arguments == ""
            calls[part.index] = [part.id, part.name, ""]
        else:
            assert part.id is None and part.name is None
            calls[part.index][2] += part.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("how", ["whole", "chars", "uneven"])
@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_each_format_gives_its_calls_whole_and_streamed(name, text, content, calls, how):
    parts = []
    got_content, _, got_calls = run(ChatOutput(tools=ToolStream(PARSERS[name](FUNCTIONS))), text, how, parts)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    # Streamed, the same calls: the same ids and names, arguments that mean the same.
    assert [(i, n, json.loads(a)) for i, n, a in joined(parts)] == \
        [(c.id, c.name, json.loads(c.arguments)) for c in got_calls]
    assert len({c.id for c in got_calls}) == len(got_calls)
    if name == "mistral":  # its templates take 9 letters or digits only
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)
    else:
        assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("how", ["whole", "chars", "uneven"])
@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_come_back_as_text(name, text, how):
    content, _, calls = run(ChatOutput(tools=ToolStream(PARSERS[name](FUNCTIONS))), text, how)
    assert (content, calls) == (text, [])


def test_a_call_is_handed_out_as_soon_as_it_is_written():
    stream = ToolStream(PARSERS["hermes"](FUNCTIONS))
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert stream.feed("Looking <") == ("Looking ", [], [])  # "<" may start the marker: held
    content, calls, _ = stream.feed(first[1:])
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    content, calls, parts = stream.feed('\n<tool_call>\n{"name": "search", "arguments": {}}')
    assert (content, calls) == ("", []) and [p.name for p in parts if p.name] == ["search"]
    content, calls, _ = stream.finish()  # the second one's closing tag never came
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("search", "{}")]


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [3, {"x": 1}]}}\n'
               '</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'),
])
def test_arguments_stream_as_the_model_writes_them(name, text):
    """Fed a character at a time, the call's name goes out once its arguments begin, and every
    character of the arguments object goes out as it comes, not when the call is whole."""
    stream = ToolStream(PARSERS[name](FUNCTIONS))
    start = text.index("{", text.index("get_weather"))
    arguments = text[start:json.JSONDecoder().raw_decode(text, start)[1]]
    sent, named_at = "", None
    for i, ch in enumerate(text):
        _, calls, parts = stream.feed(ch)
        if any(p.name for p in parts):
            named_at = i
        sent += "".join(p.arguments for p in parts)
        if start <= i < start + len(arguments) - 1:
            assert sent == text[start:i + 1] and not calls, i  # within the object: everything so far
    assert named_at == start  # the name goes out with the object's first character
    _, calls, parts = stream.finish()
    sent += "".join(p.arguments for p in parts)
    assert sent == arguments
    whole = run(ChatOutput(tools=ToolStream(PARSERS[name](FUNCTIONS))), text, "whole")[2]
    assert json.loads(sent) == json.loads(whole[0].arguments)


def test_a_named_call_streams_its_arguments_as_they_come():
    parts = []
    _, _, calls = run(ChatOutput(tools=NamedCall("get_weather")), '{"city": "Paris"}', "chars", parts)
    assert len(parts) == 1 + len('{"city": "Paris"}')
    assert joined(parts) == [(calls[0].id, "get_weather", '{"city": "Paris"}')]


def test_text_after_the_calls_is_content_and_not_parallel_keeps_the_first_call():
    text = RECORDED[1][1] + "\nDone."
    content, _, calls = run(ChatOutput(tools=ToolStream(PARSERS["hermes"](FUNCTIONS))), text, "chars")
    assert content == "Let me look that up.\n" + "\nDone." and len(calls) == 2
    for how in ("whole", "chars"):
        parts = []
        _, _, calls = run(ChatOutput(tools=ToolStream(PARSERS["hermes"](FUNCTIONS), parallel=False)), text, how,
                          parts)
        assert [c.name for c in calls] == ["get_weather"]
        assert [(i, n) for i, n, _ in joined(parts)] == [(calls[0].id, "get_weather")]  # nothing of the second


def test_qwen3_xml_reads_values_by_their_parameter_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n7\n"
            "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    _, _, calls = run(ChatOutput(tools=ToolStream(PARSERS["qwen3_xml"](FUNCTIONS))), text, "whole")
    # city is a string even when it looks like a number; an unknown parameter is read as JSON.
    assert json.loads(calls[0].arguments) == {"city": "42", "days": 7, "metric": True, "extra": [1, 2]}


# ---- tool_choice ---------------------------------------------------------------------------

def test_required_and_named_constraints_are_schemas_the_grammar_compiles_and_calls_validate():
    for parallel in (True, False):
        schema = constraint_schema(ToolChoice("required", None, parallel), FUNCTIONS)
        check_grammar(StructuredOutput(json_schema=schema))
        calls = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "search", "parameters": {}}]
        if parallel:
            jsonschema.validate(calls, json.loads(schema))
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(calls, json.loads(schema))
        with pytest.raises(jsonschema.ValidationError):  # a name no tool has
            jsonschema.validate([{"name": "other", "parameters": {}}], json.loads(schema))
    named = constraint_schema(ToolChoice("function", FUNCTIONS[0]), FUNCTIONS)
    assert json.loads(named) == WEATHER
    assert constraint_schema(ToolChoice("auto"), FUNCTIONS) is None


def test_required_output_and_a_named_call_become_tool_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "search", "parameters": ' \
           '{"query": "Rome \\"old\\" town"}}]'
    for how in ("whole", "chars"):
        content, _, calls = run(ChatOutput(tools=ToolStream(RequiredCalls(FUNCTIONS))), text, how)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS, ROME]
    content, _, calls = run(ChatOutput(tools=NamedCall("get_weather")), '{"city": "Paris"}', "chars")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("tools,kwargs,match", [
    ([{"type": "retrieval"}], {}, r"tools\[0\].type"),
    ([{"type": "function"}], {}, r"tools\[0\].function"),
    ([{"type": "function", "function": {"name": ""}}], {}, r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], {}, r"tools\[0\].function.parameters"),
    (TOOLS + TOOLS[:1], {}, r"tools\[2\].function.name: 'get_weather' is offered twice"),
    (TOOLS, {"mode": "auto"}, "needs a server started with --enable-auto-tool-choice"),
    (TOOLS, {}, "needs a server started with --enable-auto-tool-choice"),
    (TOOLS, {"function": "nope"}, "no tool is named 'nope'"),
    (TOOLS, {"mode": "sometimes"}, "must be"),
    ([], {"mode": "required"}, "needs tools"),
    ([], {"function": "get_weather"}, "needs tools"),
])
def test_tool_choice_refusals_name_the_field(tools, kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        resolve_tool_choice(kwargs.get("mode", ""), kwargs.get("function", ""), functions_of(tools), None,
                            auto_enabled=False)


def test_tool_choice_defaults():
    assert resolve_tool_choice("", "", [], None, auto_enabled=False).mode == "none"
    assert resolve_tool_choice("", "", FUNCTIONS, None, auto_enabled=True).mode == "auto"
    assert resolve_tool_choice("none", "", FUNCTIONS, None, auto_enabled=False).mode == "none"
    named = resolve_tool_choice("", "search", FUNCTIONS, False, auto_enabled=False)
    assert (named.mode, named.function.name, named.parallel) == ("function", "search", False)
    assert functions_of([{"type": "function", "function": {"name": "f"}}])[0] == Function("f", {"type": "object"})


# ---- reasoning -----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["whole", "chars", "uneven"])
@pytest.mark.parametrize("parser,state,text,reasoning,content", [
    ("deepseek_r1", "open", "Let me think.\nParis is big.\n</think>\n\nParis.", "Let me think.\nParis is big.\n",
     "\n\nParis."),
    ("deepseek_r1", "", "<think>\nHmm.</think>Paris.", "\nHmm.", "Paris."),
    ("deepseek_r1", "", "Thinking that never ends", "Thinking that never ends", ""),
    ("deepseek_r1", "closed", "Paris.", "", "Paris."),
    ("qwen3", "", "<think>\nThe user asks.\n</think>\n\nParis.", "\nThe user asks.\n", "\n\nParis."),
    ("qwen3", "", "Paris, no thinking.", "", "Paris, no thinking."),
    ("qwen3", "", "<thinking is not a tag", "", "<thinking is not a tag"),
    ("qwen3", "closed", "Paris.", "", "Paris."),
    ("qwen3", "open", "Cut off by max_tokens", "Cut off by max_tokens", ""),
])
def test_reasoning_is_split_from_the_answer(parser, state, text, reasoning, content, how):
    got_content, got_reasoning, _ = run(ChatOutput(reasoning=REASONING[parser]().stream(state)), text, how)
    assert (got_reasoning, got_content) == (reasoning, content)


def test_reasoning_then_a_tool_call():
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris", "days": 3}}\n</tool_call>'
    for how in ("whole", "chars"):
        output = ChatOutput(REASONING["qwen3"]().stream(""), ToolStream(PARSERS["hermes"](FUNCTIONS)))
        content, reasoning, calls = run(output, text, how)
        assert (content, reasoning) == ("\n", "I need the weather.")
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS]


def test_the_prompts_state_is_whichever_marker_comes_last():
    markers = ReasoningMarkers(start_ids=(7,), end_ids=(8, 9))
    assert markers.prompt_state([1, 2, 3]) == ""
    assert markers.prompt_state([1, 7, 2]) == "open"
    assert markers.prompt_state([1, 7, 2, 8, 9, 4]) == "closed"
    assert markers.prompt_state([8, 9, 7, 5]) == "open"
    assert markers.prompt_state([7, 8, 5, 9]) == "open"  # the end marker is two tokens, not one


def test_held_back_is_the_longest_possible_start_of_a_marker():
    assert held_back("abc <too", ["<tool_call>"]) == 4
    assert held_back("abc", ["<tool_call>"]) == 0
    assert held_back("x[TOOL", ["[TOOL_CALLS]", "<t"]) == 5


def test_qwen3_xml_streams_the_json_of_its_parameters_as_they_come():
    """The parser writes the JSON: a string parameter's text goes out as it comes (never what may
    be its closing tag or the newline before it), a number once whole; joined, the parts are
    exactly the whole call's arguments."""
    text = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"ris\n</parameter>\n<parameter=days>\n3\n'
            '</parameter>\n</function>\n</tool_call>')
    stream = ToolStream(PARSERS["qwen3_xml"](FUNCTIONS))
    sent, seen = "", {}
    for i, ch in enumerate(text):
        _, calls, parts = stream.feed(ch)
        sent += "".join(p.arguments for p in parts)
        seen[text[:i + 1]] = sent
    assert seen[text[:text.index("Pa") + 2]] == '{"city": "Pa'
    assert seen[text[:text.index('ris') + 3]] == '{"city": "Pa\\"ris'
    assert seen[text[:text.index("</parameter>") + 5]] == '{"city": "Pa\\"ris'  # "</par" may close it: held
    assert seen[text[:text.index("3") + 1]] == '{"city": "Pa\\"ris", "days": '  # a number waits for its end
    _, calls, parts = stream.finish()
    sent += "".join(p.arguments for p in parts)
    assert calls == [] and sent == '{"city": "Pa\\"ris", "days": 3}'
    whole = run(ChatOutput(tools=ToolStream(PARSERS["qwen3_xml"](FUNCTIONS))), text, "whole")[2]
    assert sent == whole[0].arguments


def test_pythonic_streams_the_json_of_its_arguments_as_they_come():
    """Fed a character at a time: the name goes out once its "(" is written, a string argument's
    text as it comes (an escape once whole), another value once its comma or ")" ends it; each
    call is handed out at its ")", before the list closes; joined, the parts are exactly each
    whole call's arguments."""
    text = """[get_weather(city="Pa\\"ris", days=3, metric=true), search(query='Rome')]"""
    stream = ToolStream(PARSERS["pythonic"](FUNCTIONS))
    sent, seen, handed = "", {}, {}
    for i, ch in enumerate(text):
        _, calls, parts = stream.feed(ch)
        sent += "".join(p.arguments for p in parts)
        seen[text[:i + 1]] = (sent, [p.name for p in parts if p.name])
        for call in calls:
            handed[call.name] = i
    at = lambda piece: seen[text[:text.index(piece) + len(piece)]]  # noqa: E731
    assert at("get_weathe") == ("", []) and at("get_weather(") == ("{", ["get_weather"])
    assert at('city="Pa')[0] == '{"city": "Pa'
    assert at('city="Pa\\')[0] == '{"city": "Pa'  # an escape being written: held
    assert at('city="Pa\\"r')[0] == '{"city": "Pa\\"r'
    assert at("days=3")[0] == '{"city": "Pa\\"ris", "days": '  # a number waits for its end
    assert at("days=3,")[0] == '{"city": "Pa\\"ris", "days": 3'
    assert handed["get_weather"] == text.index(")") + 1  # at the "," after it, not at the list's "]"
    assert at("metric=true)")[0] == '{"city": "Pa\\"ris", "days": 3, "metric": true}'
    assert at("search(")[1] == ["search"] and at("query='Ro")[0].endswith('{"query": "Ro')
    _, calls, parts = stream.finish()
    sent += "".join(p.arguments for p in parts)
    assert calls == [] and handed["search"] == len(text) - 1
    whole = run(ChatOutput(tools=ToolStream(PARSERS["pythonic"](FUNCTIONS))), text, "whole")[2]
    assert sent == whole[0].arguments + whole[1].arguments


def test_pythonic_calls_before_one_that_does_not_parse_stay_calls():
    """As with the other formats, calls written in full are handed out; what follows a broken one
    comes back as content (whole and streamed alike)."""
    text = '[get_weather(city="Paris", days=3), search(query=Rome)]'
    for how in ("whole", "chars", "uneven"):
        content, _, calls = run(ChatOutput(tools=ToolStream(PARSERS["pythonic"](FUNCTIONS))), text, how)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS]
        assert content == ", search(query=Rome)]"
