"""Tools, tool config, executor error isolation, and the hermes parser."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from postrl.tools import (
    TOOLS,
    BaseTool,
    ToolConfigError,
    ToolExecutor,
    ToolResponse,
    get_tool_parser,
    load_tool_config,
    register_tool,
)
from postrl.tools.calculator import CalculatorError, safe_eval

# ----------------------------------------------------------------------------- calculator


def test_calculator_exact_big_integers():
    assert safe_eval("123456789 * 987654321") == 121932631112635269
    assert safe_eval("(2**64 + 1) - 2**64") == 1
    assert safe_eval("10 / 4") == 2.5
    assert safe_eval("10**30 / 10**10") == 10**20  # exact division stays an exact int
    assert safe_eval("-7 // 2") == -4 and safe_eval("7 % -3") == -2


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('id')", "not allowed"),
        ("x + 1", "not allowed"),
        ("(1).real", "not allowed"),
        ("9**9**9", "exponent"),
        ("10**5000 * 10**5000 * 10**5000", "digits"),
        ("1/0", "division by zero"),
        ("2 +", "not a valid expression"),
        ("1 < 2", "not allowed"),
        ("'a' * 3", "not allowed"),
    ],
)
def test_calculator_rejects(expr, why):
    t0 = time.monotonic()
    with pytest.raises(CalculatorError, match=why):
        safe_eval(expr)
    assert time.monotonic() - t0 < 0.5


def test_calculator_tool_returns_errors_as_text():
    tool = TOOLS.get("calculator")()
    ok = asyncio.run(tool.execute("i", {"expression": "999999999 * 999999999"}))
    assert ok.text == "999999998000000001"
    bad = asyncio.run(tool.execute("i", {"expression": "open('x')"}))
    assert bad.text.startswith("Error:") and bad.metrics["tool/calculator/errors"] == 1


# ----------------------------------------------------------------------------- search


def test_search_tool_bm25_over_jsonl_and_parquet(tmp_path):
    docs = [
        {"id": 0, "title": "Paris", "text": "Paris is the capital of France."},
        {"id": 1, "title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"id": 2, "title": "Bananas", "text": "Bananas are yellow fruit rich in potassium."},
    ]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(d) for d in docs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(docs), parquet)
    for path in (jsonl, parquet):
        tools = load_tool_config(
            [{"class_name": "search", "config": {"corpus_path": str(path), "top_k": 2}}]
        )
        resp = asyncio.run(tools["search"].execute("i", {"query": "capital of Germany"}))
        assert resp.text.splitlines()[0].startswith("[1] Berlin:"), resp.text
        assert "Bananas" not in resp.text
        none = asyncio.run(tools["search"].execute("i", {"query": "zzzz"}))
        assert none.text == "No results."


# ----------------------------------------------------------------------------- config


def test_tool_config_yaml_registered_name_and_import_path(tmp_path):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text("""
tools:
  - class_name: calculator
    config: {max_digits: 50}
  - class_name: postrl.tools.calculator:CalculatorTool
    tool_schema:
      type: function
      function:
        name: calc2
        description: same, another name
        parameters: {type: object, properties: {expression: {type: string}},
                     required: [expression]}
""")
    tools = load_tool_config(cfg)
    assert sorted(tools) == ["calc2", "calculator"]
    r = asyncio.run(tools["calculator"].execute("i", {"expression": "10**60"}))
    assert "exceed 50 digits" in r.text
    ex = ToolExecutor(tools)
    assert [s["function"]["name"] for s in ex.schemas()] == ["calculator", "calc2"]


def test_tool_config_reports_all_errors_at_once():
    with pytest.raises(ToolConfigError) as e:
        load_tool_config(
            {
                "tools": [
                    {"class_name": "calculater"},
                    {
                        "class_name": "calculator",
                        "tool_schema": {"type": "function", "function": {"name": ""}},
                    },
                    {"class_name": "search", "config": {}},
                    {"class_name": "calculator", "bogus": 1},
                ]
            }
        )
    msg = str(e.value)
    assert "tools[0]" in msg and "did you mean 'calculator'" in msg
    assert "tools[1]" in msg and "name must be a non-empty string" in msg
    assert "tools[2]" in msg and "corpus_path" in msg
    assert "tools[3]" in msg and "bogus" in msg


# ----------------------------------------------------------------------------- executor


class _Misbehaving(BaseTool):
    @classmethod
    def default_schema(cls):
        return {
            "type": "function",
            "function": {
                "name": "bad",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def execute(self, instance_id, parameters):
        mode = parameters.get("mode")
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "hang":
            await asyncio.sleep(1000)
        if mode == "huge":
            return "x" * (10 * 1024 * 1024)
        if mode == "nonstring":
            return 12345
        if mode == "nonstring_text":
            return ToolResponse(text={"a": 1})
        if mode == "tuple":
            return ("tuple ok", 0.5, {"tool/custom": 2})
        return ToolResponse("fine", 0.25, {"tool/custom": 1})


class _BlockingHang(_Misbehaving):
    run_in_thread = True

    @classmethod
    def default_schema(cls):
        s = super().default_schema()
        s["function"]["name"] = "blocking"
        return s

    async def execute(self, instance_id, parameters):
        time.sleep(1.0)  # blocks whatever loop it runs on (timeout is 0.3 s)
        return "late"


@pytest.fixture()
def executor():
    return ToolExecutor(
        [_Misbehaving(), _BlockingHang(), TOOLS.get("calculator")()],
        max_tool_response_length=1000,
        timeout_s=0.3,
    )


@pytest.mark.parametrize(
    "name, args, metric, text",
    [
        ("nope", {}, "unknown_tool", "unknown tool 'nope'; available tools: bad, blocking, calc"),
        ("bad", '{"mode": "raise"', "bad_arguments", "not valid JSON"),
        ("bad", "[1, 2]", "bad_arguments", "must be a JSON object"),
        ("bad", {"mode": "raise"}, "exception", "RuntimeError: boom"),
        ("bad", {"mode": "hang"}, "timeout", "did not finish within 0.3s"),
        ("blocking", {}, "timeout", "did not finish within 0.3s"),
        ("bad", {"mode": "nonstring"}, "bad_return", "returned int"),
        ("bad", {"mode": "nonstring_text"}, "bad_return", "returned dict"),
    ],
)
def test_executor_turns_every_failure_into_an_observation(executor, name, args, metric, text):
    async def go():
        t0 = time.monotonic()
        resp = await executor.execute_tool_call(name, args, "traj-1")
        return resp, time.monotonic() - t0

    resp, dt = asyncio.run(go())
    assert resp.text.startswith("Error:") and text in resp.text, resp.text
    assert resp.metrics[f"tool/errors/{metric}"] == 1.0 and resp.metrics["tool/calls"] == 1.0
    assert executor.metrics[f"tool/errors/{metric}"] == 1
    assert dt < 1.0  # nothing wedges, not even the loop-blocking tool


def test_executor_truncates_huge_output_and_passes_good_results(executor):
    async def go():
        iid = await executor.create("t", tools_kwargs={"bad": {"create_kwargs": {"k": 1}}})
        huge = await executor.execute_tool_call("bad", {"mode": "huge"}, iid)
        good = await executor.execute_tool_call("bad", "{}", iid)
        tup = await executor.execute_tool_call("bad", {"mode": "tuple"}, iid)
        calc = await executor.execute_tool_call(
            "calculator", '{"expression": "123456789*987654321"}', iid
        )
        await executor.release(iid)
        return huge, good, tup, calc

    huge, good, tup, calc = asyncio.run(go())
    assert len(huge.text) == 1000 and huge.text.endswith("characters]")
    assert huge.metrics["tool/truncated"] == 1.0
    assert good.text == "fine" and good.reward_delta == 0.25 and good.metrics["tool/custom"] == 1
    assert tup.text == "tuple ok" and tup.reward_delta == 0.5
    assert calc.text == "121932631112635269"
    assert executor.metrics["tool/calls"] == 4


def test_register_tool_and_duplicate_names_raise():
    @register_tool("echo_test_tool")
    class Echo(_Misbehaving):
        pass

    assert TOOLS.get("echo_test_tool") is Echo
    with pytest.raises(KeyError, match="already registered"):
        register_tool("echo_test_tool")(Echo)


# ----------------------------------------------------------------------------- parser

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


def test_hermes_valid_and_multiple_calls():
    p = get_tool_parser("hermes")
    text = "Let me compute.\n" + CALL + "\n" + CALL.replace("2+2", "3*3")
    res = p.parse(text)
    assert [tuple(c) for c in res.calls] == [
        ("calculator", {"expression": "2+2"}),
        ("calculator", {"expression": "3*3"}),
    ]
    assert res.errors == [] and res.content == "Let me compute."
    name, args = res.calls[0]
    assert name == "calculator"


@pytest.mark.parametrize(
    "body, why",
    [
        ('{"name": "calculator", "arguments": {"expression": "2+2"}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', "no string 'name'"),
        ('{"name": "c", "arguments": [1]}', "'arguments' must be a JSON object"),
        ('{"name": "c", "arguments": "{bad"}', "'arguments' string is not valid JSON"),
    ],
)
def test_hermes_malformed_calls_become_errors(body, why):
    res = get_tool_parser("hermes").parse(f"x <tool_call>{body}</tool_call> " + CALL)
    assert len(res.errors) == 1 and why in res.errors[0].message
    assert len(res.calls) == 1  # the valid call after the bad one still parses
    assert res.has_calls


def test_hermes_unterminated_and_string_arguments():
    p = get_tool_parser("hermes")
    res = p.parse('<tool_call>{"name": "calculator", "arguments": {"expr')
    assert res.calls == [] and "unterminated" in res.errors[0].message
    res = p.parse('<tool_call>{"name": "c", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert res.calls == [("c", {"a": 1})]
    assert p.parse("no calls here").has_calls is False


def test_hermes_calls_inside_code_blocks_do_not_count_by_default():
    text = "Format example:\n```\n" + CALL + "\n```\nNow for real:\n" + CALL.replace("2+2", "5")
    res = get_tool_parser("hermes").parse(text)
    assert res.calls == [("calculator", {"expression": "5"})] and res.ignored_in_code == 1
    res_all = get_tool_parser("hermes", calls_in_code_blocks=True).parse(text)
    assert len(res_all.calls) == 2 and res_all.ignored_in_code == 0


def test_unknown_parser_lists_choices():
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("hermez")


# ----------------------------------------------------------------------------- python tool


def test_python_tool_through_the_executor():
    from postrl.tools.sandbox import Sandbox, SandboxConfig

    if Sandbox(SandboxConfig()).isolation_report().missing(SandboxConfig().required_layers):
        pytest.skip("sandbox isolation unavailable on this host")
    tools = load_tool_config(
        [{"class_name": "python", "config": {"wall_time_s": 1.0, "max_output_chars": 100}}]
    )
    ex = ToolExecutor(tools, timeout_s=5.0)

    async def go():
        ok = await ex.execute_tool_call("python", {"code": "print(123456789 * 987654321)"}, "t")
        slow = await ex.execute_tool_call("python", {"code": "import time; time.sleep(60)"}, "t")
        loud = await ex.execute_tool_call("python", {"code": "print('y' * 10000)"}, "t")
        exc = await ex.execute_tool_call("python", {"code": "1/0"}, "t")
        return ok, slow, loud, exc

    ok, slow, loud, exc = asyncio.run(go())
    assert ok.text.strip() == "121932631112635269" and ok.error is None
    assert "[sandbox: timeout: wall time limit of 1.0s exceeded" in slow.text
    assert slow.error == "timeout" and slow.metrics["tool/python/status/timeout"] == 1.0
    assert len(loud.text) < 200 and "truncated 9901 characters" in loud.text
    assert "ZeroDivisionError" in exc.text and "[sandbox: error: exit code 1]" in exc.text
    assert exc.error is None  # a program that raises is a normal observation


def test_untrusted_sandbox_refuses_when_a_required_layer_is_missing():
    from postrl.tools.sandbox import Sandbox, SandboxConfig

    sb = Sandbox(SandboxConfig(disabled_layers=("mount_namespace",)))
    rep = sb.isolation_report()
    assert rep.active["mount_namespace"] is False and "mount_namespace=off" in rep.summary()
    res = asyncio.run(sb.run_python("print('should not run')"))
    assert res.status == "refused" and "mount_namespace" in res.reason and res.stdout == ""
    assert sb.metrics["sandbox/refused"] == 1
    # trusted mode runs with what is available and says so in the report
    off = ("mount_namespace", "uid_drop")  # without the mount ns, the uid cannot reach /root
    trusted = Sandbox(SandboxConfig(disabled_layers=off, untrusted=False))
    assert asyncio.run(trusted.run_python("print('ran')")).stdout == "ran\n"
    if str(sb.python).startswith("/root/"):  # this host: the interpreter lives under /root
        assert "cannot run inside the sandbox" in rep.errors["interpreter"]
