"""Run by tests/server/test_tool_parsers.py under vLLM's own Python (a separate install, not kvgate's): reads one
JSON request on stdin, answers one JSON object on stdout.

- `cases`: each {"kind": "tool"|"reasoning", "parser", "text", "tools", "specials", "kwargs"} through vLLM's parser
  of that name (non-streaming), with a byte-level tokenizer that has the format's special tokens added (vLLM's
  parsers look their markers up in the vocabulary): {"content", "calls": [[name, arguments]]} or
  {"reasoning", "content"}, or {"error"} when vLLM's parser raised.
- `mistral_turns`: assistant messages with tool calls encoded by mistral_common, Mistral's own tokenizer library,
  with the tokenizer files it ships (v2, v3 and v7 SentencePiece, Tekken): for each, the text of every token as
  decoded one at a time with special tokens kept (what a server streams), minus the end-of-turn token, or
  {"refused"} where the tokenizer's version cannot write the turn (content with calls before v7).
  SentencePiece's word marker (U+2581) is written as the space it stands for, and its byte tokens as the
  characters they spell: mistral_common's decode keeps both raw when it keeps special tokens, where a server's
  detokenizer writes text.
"""

import json
import os
import re
import sys


def byte_tokenizer(byte_tokenizer_json: str, specials: list[str]):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(byte_tokenizer_json))
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def run_case(case: dict, tokenizer_json: str) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tok = byte_tokenizer(tokenizer_json, case["specials"])
    kwargs = case.get("kwargs")
    if case["kind"] == "tool":
        from vllm.tool_parsers import ToolParserManager

        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=case["tools"],
                                    tool_choice="auto")
        parser = ToolParserManager.get_tool_parser(case["parser"])(tok, req.tools)
        info = parser.extract_tool_calls(case["text"], req)
        return {"content": info.content,
                "calls": [[c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls]}
    from vllm.reasoning import ReasoningParserManager

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=kwargs)
    cls = ReasoningParserManager.get_reasoning_parser(case["parser"])
    parser = cls(tok, chat_template_kwargs=kwargs) if kwargs else cls(tok)
    reasoning, content = parser.extract_reasoning(case["text"], req)
    return {"reasoning": reasoning, "content": content}


def mistral_turns(turns: list[dict]) -> list[dict]:
    import mistral_common
    from mistral_common.protocol.instruct.messages import AssistantMessage
    from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    data = os.path.join(os.path.dirname(mistral_common.__file__), "data")
    out = []
    for name in ("mistral_instruct_tokenizer_240216.model.v2", "mistral_instruct_tokenizer_240323.model.v3",
                 "mistral_instruct_tokenizer_241114.model.v7", "tekken_240911.json"):
        instruct = MistralTokenizer.from_file(os.path.join(data, name)).instruct_tokenizer
        tok = instruct.tokenizer
        for turn in turns:
            calls = [ToolCall(id=f"call{i:05d}", function=FunctionCall(name=n, arguments=json.dumps(a)))
                     for i, (n, a) in enumerate(turn["calls"])]
            try:
                ids = instruct.encode_assistant_message(AssistantMessage(content=turn["content"], tool_calls=calls),
                                                        is_before_last_user_message=False)
            except ValueError as exc:  # content with calls: v7 and later only
                out.append({"tokenizer": f"{name} ({tok.version.value})", "turn": turn, "refused": str(exc)[:200]})
                continue
            if ids and ids[-1] == tok.eos_id:
                ids = ids[:-1]
            pieces = _streamed_pieces(tok, ids, SpecialTokenPolicy.KEEP)
            out.append({"tokenizer": f"{name} ({tok.version.value})", "pieces": pieces, "turn": turn})
    return out


_BYTE_TOKENS = re.compile(r"(?:<0x[0-9A-F]{2}>)+")


def _bytes_as_text(text: str) -> str:
    """SentencePiece's byte-fallback tokens (`<0xF0>`...) as the UTF-8 text they spell, as a server's detokenizer
    writes them: mistral_common's decode keeps them raw when it keeps special tokens (an incomplete character
    becomes U+FFFD)."""
    return _BYTE_TOKENS.sub(lambda m: bytes.fromhex(m.group()[3:-1].replace("><0x", "")).decode("utf-8", "replace"),
                            text)


def _streamed_pieces(tok, ids: list[int], policy) -> list[str]:
    """The text each token adds, as an incremental detokenizer sends it (a piece may be empty while a character
    is incomplete)."""
    pieces, sent = [], ""
    for n in range(1, len(ids) + 1):
        text = _bytes_as_text(tok.decode(ids[:n], special_token_policy=policy))
        if text.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(text[len(sent):].replace("\u2581", " "))
        sent = text
    return pieces


def main() -> None:
    request = json.load(sys.stdin)
    answer: dict = {}
    if "cases" in request:
        answer["cases"] = []
        for case in request["cases"]:
            try:
                answer["cases"].append(run_case(case, request["byte_tokenizer"]))
            except Exception as exc:  # noqa: BLE001 - reported per case: vLLM's parser raised on this text
                answer["cases"].append({"error": f"{type(exc).__name__}: {exc}"})
    if "mistral_turns" in request:
        answer["mistral_turns"] = mistral_turns(request["mistral_turns"])
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
