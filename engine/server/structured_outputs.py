"""A request's structured-output fields -> one StructuredOutputsParams, checked before it reaches the engine.

Three spellings are taken, as vLLM takes them: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` object (`json`, `json_object`, `regex`, `choice`, `grammar`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request may use one of them. The constraint is compiled
here (llguidance, cached per constraint, off the event loop) and, with the model's real tokenizer, its matcher
built, its first mask computed and one token walked under the engine's limits (engine/structured_output.py),
so a bad schema, regex or grammar — or one over the limits, like `a{200000}` — is a 400 naming the field it
came from before anything reaches the engine. A chat request's `tool_choice` (required or a named function;
not auto) is one more constraint (engine/server/tool_calls.py).
"""

from __future__ import annotations

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import StructuredOutputsParams
from kvgate.engine.server.protocol import SamplingFields
from kvgate.engine.server.tool_calls import tool_constraint, tool_mode
from kvgate.engine.structured_output import StructuredOutputManager, compile_grammar

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_params(req: SamplingFields, auto_tool_parser: str | None = None,
                              checker: StructuredOutputManager | None = None) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained); InvalidRequestError naming the field when it is bad.
    `auto_tool_parser`: the server's --tool-call-parser, when `tool_choice: auto` is enabled. `checker`: matchers
    with the served model's tokenizer, to check the constraint's cost; None checks the constraint text only."""
    found: list[StructuredOutputsParams] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutputsParams(json_object=True, param="response_format"))
    elif rf is not None and rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema", param=param)
        found.append(StructuredOutputsParams(json=rf.json_schema.schema_, param=param))
    so = req.structured_outputs
    if so is not None:
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object}
        given = {k: v for k, v in given.items() if v not in (None, False)}
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {sorted(given) or 'none'}", param="structured_outputs")
        (kind, value), = given.items()
        found.append(StructuredOutputsParams(**{kind: value}, param=f"structured_outputs.{kind}"))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append(StructuredOutputsParams(**{kind: value}, param=field))
    mode = tool_mode(req, auto_tool_parser)
    constraint = tool_constraint(req, mode) if mode is not None else None
    if constraint is not None:
        found.append(constraint)
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError("at most one structured-output constraint per request; got "
                                  + ", ".join(p.param for p in found), param=found[1].param)
    params = found[0]
    if checker is not None:
        checker.grammar_for(params)  # what the engine will build, here: a 400 instead of a stall there
    else:
        try:
            compile_grammar(params)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{params.param}: {exc}", param=params.param) from None
    return params
