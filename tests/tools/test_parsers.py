"""Tool-call parsers of every family on transcripts in the family's documented format.

Each transcript is written by hand after the source named in its comment (chat templates,
model cards, the format specs); the expected calls are read off the transcript. Every case is
parsed whole and streamed: split at every offset into two deltas, fed one character at a time
and in random pieces — the streamed result must equal the whole parse (calls, errors, content,
reasoning), since a call split anywhere must give the same result.
"""

from __future__ import annotations

import json
import random

import pytest

from postrl.tools.parsers import (
    TOOL_PARSERS,
    ParseResult,
    coerce_value,
    get_tool_parser,
)

DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object"},
                    "exact": {"type": "boolean"},
                },
            },
        },
    },
]
SEARCH_ARGS = {"query": 'café "best"', "filters": {"tags": ["a", "b"], "max": 3}}

# (id, parser, text, expected calls, expected content, number of errors, reasoning)
CASES = [
    # hermes — Qwen2.5 chat template: <tool_call>\n{json}\n</tool_call>, one block per call
    (
        "hermes-two-calls",
        "hermes",
        "I'll check both cities.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 2}}\n</tool_call>',
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo", "days": 2})],
        "I'll check both cities.",
        0,
        "",
    ),
    (
        "hermes-fenced-example-then-call",
        "hermes",
        'Format:\n```\n<tool_call>{"name": "x", "arguments": {}}</tool_call>\n```\nNow:\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        [("get_weather", {"city": "Oslo"})],
        'Format:\n```\n<tool_call>{"name": "x", "arguments": {}}</tool_call>\n```\nNow:',
        0,
        "",
    ),
    (
        "hermes-malformed-then-valid",
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
        [("get_weather", {"city": "Rome"})],
        "",
        1,
        "",
    ),
    # qwen3_coder — Qwen3-Coder-30B-A3B-Instruct chat template (function/parameter XML, the
    # value between newlines); typed by TOOLS (days: integer, city: string)
    (
        "qwen3_coder-two-calls-typed",
        "qwen3_coder",
        "Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        '<function=search>\n<parameter=query>\ncafé "best"\n</parameter>\n<parameter=filters>\n'
        '{"tags": ["a", "b"], "max": 3}\n</parameter>\n</function>\n</tool_call>',
        [("get_weather", {"city": "3", "days": 3}), ("search", SEARCH_ARGS)],
        "Let me look.",
        0,
        "",
    ),
    (
        "qwen3_coder-multiline-value-missing-close-and-bare-function",
        "qwen3_coder",
        "<tool_call>\n<function=search>\n<parameter=query>\nline one\n  line two\n\n"
        "<parameter=exact>\nTrue\n</parameter>\n</function>\n</tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>",
        [
            ("search", {"query": "line one\n  line two\n", "exact": True}),
            ("get_weather", {"city": "Lima"}),
        ],
        "",
        0,
        "",
    ),
    (
        "qwen3_coder-malformed",
        "qwen3_coder",
        "<tool_call>\n<parameter=city>\nOslo\n</parameter>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBer",
        [("get_weather", {"city": "Oslo"})],
        "",
        2,
        "",
    ),
    # gpt-oss — openai/harmony docs/format.md "Receiving tool calls": analysis, a preamble,
    # recipient in the channel part and (second call) in the role part with ` json`
    (
        "gpt-oss-analysis-preamble-two-calls",
        "gpt-oss",
        "<|channel|>analysis<|message|>Need the weather in two cities.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Tokyo"}<|call|>',
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})],
        "Checking both cities.",
        0,
        "Need the weather in two cities.",
    ),
    (
        "gpt-oss-final-answer",
        "gpt-oss",
        "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final"
        "<|message|>2 + 2 = 4.<|return|>",
        [],
        "2 + 2 = 4.",
        0,
        "Simple sum.",
    ),
    (
        "gpt-oss-stop-token-stripped",
        "gpt-oss",
        "<|channel|>commentary to=functions.search<|constrain|>json<|message|>"
        + json.dumps(SEARCH_ARGS),
        [("search", SEARCH_ARGS)],
        "",
        0,
        "",
    ),
    (
        "gpt-oss-malformed",
        "gpt-oss",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"<|call|>',
        [],
        "",
        1,
        "",
    ),
    # llama3_json — Meta llama3_1 prompt_format.md "JSON based tool calling" (bare JSON with
    # "parameters"; <|python_tag|> prefix, ';'-separated calls, extra "type" key, <|eom_id|>)
    (
        "llama3-bare",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        [("get_weather", {"city": "Paris"})],
        "<|eot_id|>",
        0,
        "",
    ),
    (
        "llama3-python-tag-two-calls",
        "llama3_json",
        'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"type": "function", "name": "search", "parameters": '
        + json.dumps(SEARCH_ARGS)
        + "}<|eom_id|>",
        [("get_weather", {"city": "Paris"}), ("search", SEARCH_ARGS)],
        "Sure.<|eom_id|>",
        0,
        "",
    ),
    (
        "llama3-json-answer-is-content",
        "llama3_json",
        '{"answer": 42, "unit": "km"}',
        [],
        '{"answer": 42, "unit": "km"}',
        0,
        "",
    ),
    (
        "llama3-malformed",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "search", "parameters": {"query"',
        [("get_weather", {"city": "Paris"})],
        "",
        1,
        "",
    ),
    # mistral — mistral-common tokenizer v3 (JSON array with ids), v11 ([CALL_ID]) and v13
    # (NAME[ARGS]{json}, chained without separator)
    (
        "mistral-v3-array",
        "mistral",
        'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, '
        '"id": "abcDEF123"}, {"name": "get_weather", "arguments": {"city": "Bern"}, '
        '"id": "xyzXYZ789"}]</s>',
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Bern"})],
        "Checking.</s>",
        0,
        "",
    ),
    # llama.cpp's copy of the Mistral-Small-3.1 template renders OpenAI history: the function
    # object through tojson (arguments as a JSON string), then the id
    (
        "mistral-small-3.1-template",
        "mistral",
        '[TOOL_CALLS] [{"arguments": "{\\"city\\": \\"Paris\\"}", "name": "get_weather", '
        '"id": "abcDEF123"}]</s>',
        [("get_weather", {"city": "Paris"})],
        "</s>",
        0,
        "",
    ),
    (
        "mistral-v11-call-id",
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Zürich"}'
        '[TOOL_CALLS]get_weather[CALL_ID]xyzXYZ789[ARGS]{"city": "Bern"}</s>',
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Bern"})],
        "</s>",
        0,
        "",
    ),
    (
        "mistral-v13-compact",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 2}'
        "[TOOL_CALLS]search[ARGS]" + json.dumps(SEARCH_ARGS),
        [("get_weather", {"city": "Zürich", "days": 2}), ("search", SEARCH_ARGS)],
        "",
        0,
        "",
    ),
    (
        "mistral-malformed",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", }[TOOL_CALLS]search[ARGS]{"query": "x"',
        [],
        "",
        2,
        "",
    ),
    # deepseek — DeepSeek-R1-0528 chat template (V3 form: type word, name, ```json fence,
    # calls separated by \n) and DeepSeek-V3.1 (name<sep>{json}, chained)
    (
        "deepseek-v3-two-calls",
        "deepseek_v3",
        f"Let me check.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Zürich"}}\n```{DS_CALL_END}\n{DS_CALL_BEGIN}function{DS_SEP}search\n'
        f"```json\n{json.dumps(SEARCH_ARGS)}\n```{DS_CALL_END}{DS_CALLS_END}{DS_EOS}",
        [("get_weather", {"city": "Zürich"}), ("search", SEARCH_ARGS)],
        f"Let me check.\n{DS_EOS}",
        0,
        "",
    ),
    (
        "deepseek-v31-chained",
        "deepseek_v31",
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": "Zürich"}}{DS_CALL_END}'
        f"{DS_CALL_BEGIN}search{DS_SEP}{json.dumps(SEARCH_ARGS)}{DS_CALL_END}{DS_CALLS_END}",
        [("get_weather", {"city": "Zürich"}), ("search", SEARCH_ARGS)],
        "",
        0,
        "",
    ),
    (
        "deepseek-malformed",
        "deepseek_v3",
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": }}{DS_CALL_END}'
        f"{DS_CALL_BEGIN}function get_weather{DS_CALL_END}"
        f'{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": "Oslo"}}{DS_CALL_END}{DS_CALLS_END}',
        [("get_weather", {"city": "Oslo"})],
        "",
        2,
        "",
    ),
    # glm45 — GLM-4.5 chat template (newline-separated) and GLM-4.7 (compact); values are
    # raw text typed by TOOLS (a string "007" stays a string, days becomes an int)
    (
        "glm45-two-calls",
        "glm45",
        "<think>Two lookups.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>007</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n"
        '<arg_value>café "best"</arg_value>\n<arg_key>filters</arg_key>\n'
        '<arg_value>{"tags": ["a", "b"], "max": 3}</arg_value>\n</tool_call>',
        [("get_weather", {"city": "007", "days": 3}), ("search", SEARCH_ARGS)],
        "<think>Two lookups.</think>",
        0,
        "",
    ),
    (
        "glm47-compact",
        "glm45",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>  two  spaces</arg_value>"
        "</tool_call><tool_call>search<arg_key>exact</arg_key><arg_value>true</arg_value>"
        "</tool_call>",
        [("get_weather", {"city": "  two  spaces"}), ("search", {"exact": True})],
        "",
        0,
        "",
    ),
    # llama.cpp's copy of the GLM-4.5 template (models/templates/glm_4_5.jinja): its
    # whitespace control glues the first key to the name and drops the newline before the end
    (
        "glm45-llamacpp-template",
        "glm45",
        "<think></think>\n<tool_call>get_weather<arg_key>city</arg_key>\n<arg_value>Oslo"
        "</arg_value><arg_key>days</arg_key>\n<arg_value>2</arg_value></tool_call>",
        [("get_weather", {"city": "Oslo", "days": 2})],
        "<think></think>",
        0,
        "",
    ),
    (
        "glm45-malformed",
        "glm45",
        "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\nOslo\n</tool_call>",
        [],
        "",
        2,
        "",
    ),
    # kimi_k2 — Kimi-K2-Instruct chat template / docs/tool_call_guidance.md (ids
    # functions.NAME:IDX with a global counter, no separator between calls)
    (
        "kimi-two-calls",
        "kimi_k2",
        "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|><|tool_call_begin|>'
        "functions.search:1<|tool_call_argument_begin|>"
        + json.dumps(SEARCH_ARGS)
        + "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
        [("get_weather", {"city": "Zürich"}), ("search", SEARCH_ARGS)],
        "I'll check.<|im_end|>",
        0,
        "",
    ),
    (
        "kimi-malformed",
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
        'functions.search:2<|tool_call_argument_begin|>{"query": "x"',
        [("get_weather", {"city": "Oslo"})],
        "",
        2,
        "",
    ),
]
IDS = [c[0] for c in CASES]


def _check(res: ParseResult, case) -> None:
    _, _, _, calls, content, n_errors, reasoning = case
    assert [tuple(c) for c in res.calls] == calls
    assert len(res.errors) == n_errors, res.errors
    assert res.content == content
    assert res.reasoning == reasoning


def _stream(parser, pieces: list[str]) -> ParseResult:
    s = parser.stream(TOOLS)
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    res = s.result()
    # what the deltas released adds up to the result
    assert "".join(d.content for d in deltas) == res.content
    assert "".join(d.reasoning for d in deltas) == res.reasoning
    assert [c for d in deltas for c in d.calls] == res.calls
    assert [e for d in deltas for e in d.errors] == res.errors
    assert [i for d in deltas for i in d.call_ids] == res.call_ids
    return res


def _same(a: ParseResult, b: ParseResult) -> bool:
    fields = ("calls", "call_ids", "errors", "content", "reasoning", "ignored_in_code")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def test_every_family_is_registered():
    assert set(TOOL_PARSERS.names()) >= {
        "hermes",
        "qwen3_coder",
        "gpt-oss",
        "llama3_json",
        "mistral",
        "deepseek_v3",
        "deepseek_v31",
        "glm45",
        "kimi_k2",
    }
    assert {c[1] for c in CASES} == set(TOOL_PARSERS.names())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_transcript(case):
    parser = get_tool_parser(case[1])
    res = parser.parse(case[2], TOOLS)
    _check(res, case)
    for e in res.errors:  # the error observation names the family's syntax
        assert str(e).startswith("Error: ") and parser.expected in str(e)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_split_at_every_offset(case):
    parser, text = get_tool_parser(case[1]), case[2]
    whole = parser.parse(text, TOOLS)
    for k in range(len(text) + 1):
        assert _same(_stream(parser, [text[:k], text[k:]]), whole), f"split at {k}"
    assert _same(_stream(parser, list(text)), whole)  # one character per delta
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 4))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _same(_stream(parser, pieces), whole)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_truncated_generations_never_raise(case):
    """Every prefix (a generation cut by max_tokens) parses whole and streamed alike."""
    parser, text = get_tool_parser(case[1]), case[2]
    rng = random.Random(1)
    for k in range(0, len(text) + 1, 3):
        prefix = text[:k]
        whole = parser.parse(prefix)
        assert isinstance(whole, ParseResult)
        cut = rng.randint(0, k)
        s = parser.stream()
        s.feed(prefix[:cut])
        s.feed(prefix[cut:])
        s.finish()
        assert _same(s.result(), whole), f"prefix {k} split at {cut}"


@pytest.mark.parametrize(
    "case_id, ids",
    [
        ("kimi-two-calls", ["functions.get_weather:0", "functions.search:1"]),
        ("mistral-v3-array", ["abcDEF123", "xyzXYZ789"]),
        ("mistral-v11-call-id", ["abcDEF123", "xyzXYZ789"]),
        ("mistral-v13-compact", [None, None]),
        ("hermes-two-calls", [None, None]),
    ],
)
def test_call_ids_the_model_wrote_are_kept(case_id, ids):
    case = CASES[IDS.index(case_id)]
    assert get_tool_parser(case[1]).parse(case[2]).call_ids == ids
    new = get_tool_parser("mistral").new_call_id()
    assert len(new) == 9 and new.isalnum()


def test_without_schema_values_are_json_decoded():
    xml = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n"
        "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    )
    assert get_tool_parser("qwen3_coder").parse(xml).calls == [
        ("get_weather", {"city": 3, "days": "three"})
    ]
    # with the schema: city is a string, days an integer that does not parse -> kept as text
    assert get_tool_parser("qwen3_coder").parse(xml, TOOLS).calls == [
        ("get_weather", {"city": "3", "days": "three"})
    ]


@pytest.mark.parametrize(
    "raw, schema, want",
    [
        ("3", {"type": "integer"}, 3),
        ("3.5", {"type": "number"}, 3.5),
        ("3", {"type": "string"}, "3"),
        ("null", {"type": ["string", "null"]}, None),
        ("x", {"type": ["integer", "string"]}, "x"),
        ("True", {"type": "boolean"}, True),
        ("{'a': True}", {"type": "object"}, {"a": True}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("123_456", None, "123_456"),
        ("[1, 2]", None, [1, 2]),
        ("red", {"enum": ["red", "blue"]}, "red"),
    ],
)
def test_coerce_value(raw, schema, want):
    assert coerce_value(raw, schema) == want


def test_unknown_parser_lists_every_choice():
    with pytest.raises(KeyError, match="did you mean 'qwen3_coder'") as e:
        get_tool_parser("qwen3_codr")
    assert "kimi_k2" in str(e.value) and "gpt-oss" in str(e.value)


def test_plain_text_passes_through_every_parser():
    text = "The answer is 4. Nothing to call here; {braces} and [brackets] are fine."
    for name in TOOL_PARSERS.names():
        res = get_tool_parser(name).parse(text)
        assert res.calls == [] and res.errors == [] and res.content == text, name


def test_config_validation_lists_the_parsers():
    from postrl.config import ConfigError, load_config, validate_config

    base = ["model.path=m", "data.train_files=[t.parquet]"]
    for name in TOOL_PARSERS.names():
        cfg = load_config(None, [*base, f"rollout.agent.tool_parser={name}"])
        validate_config(cfg, check_files=False)
    cfg = load_config(None, [*base, "rollout.agent.tool_parser=qwen3_codr"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False)
    msg = str(e.value)
    assert "rollout.agent.tool_parser='qwen3_codr'" in msg and "did you mean 'qwen3_coder'" in msg
    assert "glm45" in msg  # the choices are listed


SOUP = [
    "<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>",
    "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "```", "`", "\n",
    " ", "f", "{", "}", "[", "]", '"', ";", ":", ",", "\\", '{"a": 1}',
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "f", "parameters": {}}', "<|start|>",
    "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
    "<|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|python_tag|>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN,
    DS_CALL_END, DS_SEP, "function", "```json", "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>", "<|tool_call_begin|>", "functions.f:0",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS.names()))
def test_random_marker_soup_never_raises_and_streams_alike(name):
    """Random sequences of every family's markers and JSON pieces (broken on purpose): no
    exception, and any split of the stream gives the whole-text result."""
    parser, rng = get_tool_parser(name), random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 25)))
        whole = parser.parse(text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _same(_stream(parser, pieces), whole), (text, cuts)
