"""The tool-call and reasoning parsers on assistant turns that the model families' own libraries write
(tests/server/family_formats.py: Meta's llama-models, Qwen's qwen-agent), in their own tokenizers' tokens: each
parser recovers the calls (names, arguments) and the content the library wrote, from the finished text and from
the text streamed token by token as the server's detokenizer sends it. tests/server/test_parsers_vs_vllm.py reads
the same turns with vLLM's parsers."""

import importlib.util
import json

import pytest

from kvgate.engine.server.chat_output import ChatOutput
from kvgate.engine.server.reasoning_parsers import reasoning_parser
from kvgate.engine.server.tool_calls import ToolMode
from kvgate.engine.server.tool_parsers import tool_parser

for _library in ("llama_models", "qwen_agent"):  # test dependencies (qwen-agent's package __init__ is not run)
    if importlib.util.find_spec(_library) is None:
        pytest.skip(f"{_library} (a test dependency) is not installed", allow_module_level=True)

from tests.server.family_formats import llama_turns, qwen_read_back, qwen_turns  # noqa: E402

TOOL_TURNS = [t for t in llama_turns() + qwen_turns() if t.reasoning is None]
THINKING_TURNS = [t for t in qwen_turns() if t.reasoning is not None]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed]


def _streamed(parser, pieces) -> tuple[str, list]:
    stream, sent, calls = parser.stream(), [], []
    for piece in pieces:
        content, done = stream.feed(piece)
        sent.append(content)
        calls += done
    content, done = stream.finish()
    return "".join(sent) + content, calls + done


@pytest.mark.parametrize("turn", TOOL_TURNS, ids=[t.family for t in TOOL_TURNS])
def test_parser_recovers_the_turn_its_familys_library_wrote(turn):
    assert len(turn.pieces) > 3 and any(p for p in turn.pieces)
    parser = tool_parser(turn.parser, TOOLS)
    content, calls = parser.extract(turn.text)
    assert _calls(calls) == list(turn.calls), turn.text
    if turn.calls:
        assert (content or "").strip() == (turn.content or ""), turn.text
    else:  # a built-in tool (no JSON call): the turn is text, whole
        assert content == turn.text
    streamed_content, streamed_calls = _streamed(tool_parser(turn.parser, TOOLS), turn.pieces)
    assert streamed_calls == calls
    assert streamed_content == (content or ""), turn.pieces


def test_the_turns_stream_in_many_pieces_and_split_characters():
    """The streaming above is a real test: markers and characters arrive in several tokens."""
    split_tags = [t for t in TOOL_TURNS if t.parser == "hermes" and "<tool_call>" not in t.pieces]
    assert split_tags and all(len(t.pieces) > 30 for t in split_tags)
    assert any("" in t.pieces for t in TOOL_TURNS)  # a token that ends inside a character sends nothing yet
    assert {t.parser for t in TOOL_TURNS} == {"llama3_json", "llama4_json", "pythonic", "hermes"}


def _chat_output() -> ChatOutput:
    return ChatOutput(mode=ToolMode(None, tool_parser("hermes", TOOLS)), reasoning=reasoning_parser("qwen3"))


def _streamed_message(pieces) -> dict:
    """The deltas of a stream, gathered: reasoning, content and calls."""
    stream, reasoning, content, calls = _chat_output().stream(), [], [], []
    for i, piece in enumerate(pieces):
        deltas, _ = stream.deltas(piece, "stop" if i == len(pieces) - 1 else None)
        for delta in deltas:
            reasoning.append(delta.get("reasoning") or "")
            content.append(delta.get("content") or "")
            calls += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in delta.get("tool_calls", [])]
    return {"reasoning": "".join(reasoning) or None, "content": "".join(content) or None, "calls": calls}


@pytest.mark.parametrize("turn", THINKING_TURNS, ids=[t.family for t in THINKING_TURNS])
def test_qwen3_thinking_and_calls_split_as_qwen_agent_reads_them(turn):
    """A Qwen3 turn: its thinking, then content and calls from qwen-agent's writer. The chat output (reasoning
    parser qwen3, then hermes) splits it as qwen-agent's own reader does, whole and token by token."""
    reasoning, content, calls = qwen_read_back(turn.text)
    assert calls == list(turn.calls) and content.strip() == turn.content and reasoning == turn.reasoning
    message, finish = _chat_output().message("assistant", turn.text, "stop")
    assert finish == "tool_calls"
    assert message["reasoning"] == message["reasoning_content"] == reasoning
    assert message["content"].strip() == content.strip()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    streamed = _streamed_message(turn.pieces)
    assert streamed == {"reasoning": reasoning, "content": message["content"], "calls": calls}, turn.pieces


@pytest.mark.parametrize("turn", THINKING_TURNS, ids=[t.family for t in THINKING_TURNS])
def test_qwen3_thinking_opened_by_the_prompt(turn):
    """Qwen3's thinking-only models' template ends the prompt with `<think>\\n`: the output begins inside the
    thinking, and the split is the same."""
    pieces, skipped = list(turn.pieces), ""
    while len(skipped) < len("<think>"):
        skipped += pieces.pop(0)
    assert skipped.startswith("<think>")
    pieces.insert(0, skipped[len("<think>"):])  # the rest of the token that ends the tag ('>\n' in Qwen's BPE)
    whole = _chat_output().message("assistant", "".join(pieces), "stop")[0]
    assert whole["reasoning"] == turn.reasoning and len(whole["tool_calls"]) == len(turn.calls)
    streamed = _streamed_message(pieces)
    assert streamed["reasoning"] == turn.reasoning and streamed["content"] == whole["content"]
    assert streamed["calls"] == list(turn.calls)
