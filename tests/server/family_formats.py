"""Assistant turns with tool calls as the model families' own libraries write them, in their own tokenizers'
tokens, and the text of each token as a server's incremental detokenizer sends it.

- Llama (Meta's `llama-models`): the Llama 3 and Llama 4 tokenizers it ships, and its tool-call encoder
  (`ToolUtils.encode_tool_call`): JSON calls (Llama 3.1's custom tools; `llama3_json`), Python-list calls
  (Llama 3.2's and Llama 4's; `pythonic`), and Llama 3.1's built-in tools, which are no JSON call. Llama 3 turns
  come whole from its `ChatFormat.encode_message`; Llama 4's `chat_format` imports torchvision (for images), so its
  turn is built as that module builds one: the content, then each call's encoding, each tokenized alone.
- Qwen (Qwen's `qwen-agent`): `NousFnCallPrompt`, which writes Qwen2.5's and Qwen3's `<tool_call>` JSON blocks
  after the content (`hermes`), and reads a turn back (`postprocess_fncall_messages`), thinking included. Its
  tokens: the byte-level BPE qwen-agent ships (`qwen.tiktoken`), alone (a tag is several tokens) and with the
  tags Qwen2.5/Qwen3 add to it as single tokens, at their ids there.

No family library here writes Qwen3-Coder's XML calls (`qwen3_coder`); Mistral's (mistral_common) lives in vLLM's
install and is driven from tests/server/vllm_parser_oracle.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# The tags Qwen2.5 and Qwen3 add to Qwen's BPE, at their ids in those models' tokenizers (added tokens that a
# decode keeps: they are not "special").
QWEN3_ADDED_TOKENS = {"<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667, "</think>": 151668}


@dataclass(frozen=True)
class FamilyTurn:
    family: str  # who wrote it, in which format, with which tokenizer
    parser: str  # the tool-call parser that reads this format (kvgate's and vLLM's name)
    content: str | None  # the content the library wrote before the calls
    calls: tuple[tuple[str, dict], ...]  # (name, arguments) the library wrote
    pieces: tuple[str, ...]  # the text each output token adds, as streamed (the stop token left out)
    reasoning: str | None = None  # the thinking before the answer, for a thinking model

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def streamed_pieces(token_bytes: list[bytes]) -> tuple[str, ...]:
    """The text each token adds, as an incremental detokenizer sends it: bytes that do not yet make a whole
    UTF-8 character wait for the tokens that complete it (that token's piece is empty meanwhile)."""
    pieces, pending = [], b""
    for raw in token_bytes:
        pending += raw
        for cut in range(len(pending), max(len(pending) - 4, -1), -1):
            try:
                text = pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            pieces.append(text)
            pending = pending[cut:]
            break
        else:
            raise ValueError(f"not UTF-8: {pending!r}")
    assert not pending, pending
    return tuple(pieces)


def _pieces(encoding, ids: list[int], special_ids: set[int], keep_special: bool) -> tuple[str, ...]:
    return streamed_pieces([encoding.decode_single_token_bytes(i) for i in ids
                            if keep_special or i not in special_ids])


# -- Llama (llama-models) -------------------------------------------------------------------------------------------

# A tool's arguments, of the kinds llama-models writes (values one level deep): JSON any; the Python-list format
# writes strings (unescaped), numbers, booleans, None and lists (its dicts are not Python).
LLAMA_JSON_ARGS = {"city": "Köln", "days": 3, "temp": -2.5, "metric": True, "note": None,
                   "opts": {"unit": "C", "hours": 12}, "hours": [6, 12]}
LLAMA_LIST_ARGS = {"city": "Köln 🌧 東京", "days": 3, "temp": -2.5, "metric": False, "note": None,
                   "tags": ["a", "b c"]}


@cache
def _llama_tokenizers():
    from llama_models.llama3.tokenizer import Tokenizer as Llama3Tokenizer
    from llama_models.llama4.tokenizer import Tokenizer as Llama4Tokenizer

    return Llama3Tokenizer.get_instance(), Llama4Tokenizer.get_instance()


def _llama_calls(calls: list[tuple[str, dict]]):
    from llama_models.datatypes import ToolCall

    return [ToolCall(call_id=f"call{i}", tool_name=n, arguments=a) for i, (n, a) in enumerate(calls)]


def llama3_turn(family: str, parser: str, calls: list[tuple[str, dict]], fmt: str, *, builtin: str | None = None,
                keep_special: bool = False) -> FamilyTurn:
    """A Llama 3 assistant turn with these calls, from llama-models' ChatFormat (`fmt`: "json" or "python_list";
    `builtin`: one call to that built-in tool instead, with `calls[0]`'s arguments)."""
    from llama_models.datatypes import BuiltinTool, RawMessage, StopReason, ToolCall, ToolPromptFormat
    from llama_models.llama3.chat_format import ChatFormat

    tokenizer = _llama_tokenizers()[0]
    chat = ChatFormat(tokenizer)
    tool_calls = _llama_calls(calls) if builtin is None else [
        ToolCall(call_id="call0", tool_name=BuiltinTool(builtin), arguments=calls[0][1])]
    ids, _ = chat.encode_message(RawMessage(role="assistant", content="", tool_calls=tool_calls,
                                            stop_reason=StopReason.end_of_message), ToolPromptFormat(fmt))
    header = chat.encode_dialog_prompt([]).tokens[1:]  # the assistant's header: the prompt's end
    assert ids[:len(header)] == header and ids[-1] == tokenizer.special_tokens["<|eom_id|>"], ids
    pieces = _pieces(tokenizer.model, ids[len(header):-1], set(tokenizer.special_tokens.values()), keep_special)
    return FamilyTurn(family, parser, None, tuple(calls) if builtin is None else (), pieces)


def llama4_turn(family: str, parser: str, calls: list[tuple[str, dict]], fmt: str) -> FamilyTurn:
    """A Llama 4 assistant turn with these calls, as llama-models' llama4 ChatFormat.encode_message writes one:
    its content (none), then each call's ToolUtils encoding, each tokenized alone."""
    from llama_models.datatypes import ToolPromptFormat
    from llama_models.llama3.tool_utils import ToolUtils

    tokenizer = _llama_tokenizers()[1]
    ids = []
    for call in _llama_calls(calls):
        ids += tokenizer.encode(ToolUtils.encode_tool_call(call, ToolPromptFormat(fmt)), bos=False, eos=False)
    pieces = _pieces(tokenizer.model, ids, set(tokenizer.special_tokens.values()), keep_special=False)
    return FamilyTurn(family, parser, None, tuple(calls), pieces)


def llama_turns() -> list[FamilyTurn]:
    weather, time_ = ("get_weather", LLAMA_JSON_ARGS), ("get_time", {"zone": "CET"})
    weather_list = ("get_weather", LLAMA_LIST_ARGS)
    return [
        llama3_turn("Llama 3.1 JSON, one call", "llama3_json", [weather], "json"),
        llama3_turn("Llama 3.1 JSON, two calls", "llama3_json", [weather, time_], "json"),
        llama4_turn("Llama 4 JSON", "llama4_json", [weather, time_], "json"),
        llama3_turn("Llama 3.2 Python list, one call", "pythonic", [weather_list], "python_list"),
        llama3_turn("Llama 3.2 Python list, a call without arguments", "pythonic", [("get_time", {})],
                    "python_list"),
        llama3_turn("Llama 3.2 Python list, two calls", "pythonic", [weather_list, time_], "python_list"),
        llama4_turn("Llama 4 Python list", "pythonic", [weather_list, time_], "python_list"),
        # Llama 3.1's built-in tools are no JSON call: the turn is content
        llama3_turn("Llama 3.1 built-in brave_search", "llama3_json", [("", {"query": "Köln weather"})], "json",
                    builtin="brave_search"),
        llama3_turn("Llama 3.1 built-in code_interpreter, special tokens kept", "llama3_json",
                    [("", {"code": "import math\nprint(math.pi)"})], "json", builtin="code_interpreter",
                    keep_special=True),
    ]


# -- Qwen (qwen-agent) ----------------------------------------------------------------------------------------------

@cache
def qwen_agent_modules():
    """qwen-agent's function-call prompt, schema and tokenizer modules. Its package's __init__ imports its agents
    (and their service clients); these modules need none of that, so the packages above them are entered as
    bare package modules of the installed directories."""
    spec = importlib.util.find_spec("qwen_agent")
    if spec is None or spec.origin is None:
        raise ImportError("qwen-agent is not installed")
    root = Path(spec.origin).parent
    for name, path in (("qwen_agent", root), ("qwen_agent.llm", root / "llm")):
        if name not in sys.modules:  # the package, its __init__ not run
            package_spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                                  submodule_search_locations=[str(path)])
            sys.modules[name] = importlib.util.module_from_spec(package_spec)
    from qwen_agent.llm import schema
    from qwen_agent.llm.fncall_prompts import nous_fncall_prompt
    from qwen_agent.utils import tokenization_qwen

    return nous_fncall_prompt, schema, tokenization_qwen, root / "utils" / "qwen.tiktoken"


@cache
def _qwen_encodings():
    """(Qwen's BPE as qwen-agent ships it, the same with Qwen2.5/Qwen3's tags as single tokens)."""
    import tiktoken

    _, _, tokenization, vocab = qwen_agent_modules()
    shipped = tokenization.QWenTokenizer(str(vocab))
    chatml = {t: shipped.special_tokens[t] for t in (tokenization.ENDOFTEXT, tokenization.IMSTART, tokenization.IMEND)}
    with_tags = tiktoken.Encoding("Qwen3", pat_str=tokenization.PAT_STR, mergeable_ranks=shipped.mergeable_ranks,
                                  special_tokens={**chatml, **QWEN3_ADDED_TOKENS})  # Qwen3's ids, past ChatML's
    return shipped.tokenizer, with_tags


QWEN_ARGS = {"city": "Köln 🌧 東京", "days": 3, "opts": {"unit": "C", "hours": [6, 12]}, "metric": True,
             "quote": "she said \"hi\" {}"}


def qwen_assistant_text(content: str | None, calls: list[tuple[str, dict]]) -> str:
    """The assistant's text for a turn with this content and these calls, as qwen-agent's NousFnCallPrompt writes
    it into the prompt of the next turn (the text Qwen2.5 and Qwen3 are trained to write)."""
    nous, schema, _, _ = qwen_agent_modules()
    messages = [schema.Message(role="user", content=[schema.ContentItem(text="What is the weather?")])]
    if content:
        messages.append(schema.Message(role="assistant", content=[schema.ContentItem(text=content)]))
    for name, arguments in calls:
        call = schema.FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
        messages.append(schema.Message(role="assistant", content=[], function_call=call))
    functions = [{"name": n, "parameters": {"type": "object"}} for n in dict(calls)]
    rendered = nous.NousFnCallPrompt().preprocess_fncall_messages(messages, functions=functions, lang="en")
    assert [m.role for m in rendered] == ["system", "user", "assistant"], rendered
    return "".join(item.text for item in rendered[-1].content)


def qwen_read_back(text: str) -> tuple[str | None, str | None, list[tuple[str, dict]]]:
    """(reasoning, content, calls) of an assistant's output as qwen-agent reads it (postprocess_fncall_messages):
    a thinking block closed by </think> first, then content and `<tool_call>` blocks."""
    nous, schema, _, _ = qwen_agent_modules()
    messages = nous.NousFnCallPrompt().postprocess_fncall_messages(
        [schema.Message(role="assistant", content=[schema.ContentItem(text=text)])])
    texts, calls = [], []
    for message in messages:
        if message.function_call:
            calls.append((message.function_call.name, json.loads(message.function_call.arguments)))
        else:
            texts += [item.text for item in message.content]
    joined = "".join(texts)
    reasoning = None
    if "</think>" in joined:
        reasoning, _, joined = joined.partition("</think>")
        reasoning = reasoning.removeprefix("<think>")
    return reasoning, (joined or None), calls


def qwen_turn(family: str, content: str | None, calls: list[tuple[str, dict]], *, tags_as_tokens: bool,
              reasoning: str | None = None) -> FamilyTurn:
    """A Qwen assistant turn from qwen-agent's writer, with a Qwen3 thinking block before it when `reasoning`
    is given (`<think>\\n...\\n</think>\\n\\n`, as Qwen3 writes it)."""
    text = qwen_assistant_text(content, calls)
    if reasoning is not None:
        text = f"<think>\n{reasoning}\n</think>\n\n{text}"
    encoding = _qwen_encodings()[1 if tags_as_tokens else 0]
    ids = encoding.encode(text, allowed_special=set(QWEN3_ADDED_TOKENS) if tags_as_tokens else set(),
                          disallowed_special=())
    if tags_as_tokens:
        assert QWEN3_ADDED_TOKENS["<tool_call>"] in ids, ids
    pieces = _pieces(encoding, ids, set(), keep_special=True)
    assert "".join(pieces) == text
    return FamilyTurn(family, "hermes", content, tuple(calls), pieces,
                      None if reasoning is None else f"\n{reasoning}\n")


def qwen_turns() -> list[FamilyTurn]:
    weather, time_ = ("get_weather", QWEN_ARGS), ("get_time", {"zone": "CET"})
    turns = []
    for tags_as_tokens, tokenizer in ((False, "Qwen BPE"), (True, "Qwen BPE + Qwen3 tags")):
        turns += [
            qwen_turn(f"Qwen (qwen-agent), content and two calls, {tokenizer}", "Let me check the weather.",
                      [weather, time_], tags_as_tokens=tags_as_tokens),
            qwen_turn(f"Qwen (qwen-agent), one call, {tokenizer}", None, [weather], tags_as_tokens=tags_as_tokens),
            qwen_turn(f"Qwen3 (qwen-agent) thinking, then a call, {tokenizer}", "Checking.", [weather],
                      tags_as_tokens=tags_as_tokens, reasoning="The user wants Köln's weather: get_weather."),
        ]
    return turns
