"""Structured output on the default model through the LLM API: every kind
of constraint, greedy and sampled, mixed with free requests, and under
preemption and chunked prefill."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured_output.params import ConstraintError, StructuredOutputParams
from tests.json_schemas import SCHEMAS

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
FREE = ["The history of bread begins", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(plain_llm: LLM) -> LLM:
    return plain_llm


def _ask(llm: LLM, request: str) -> str:
    return llm.chat_prompt([{"role": "user", "content": request}])


def _params(so: StructuredOutputParams, **kw: object) -> SamplingParams:
    values: dict[str, object] = {"temperature": 0.0, "max_tokens": 96, **kw}
    return SamplingParams(structured_outputs=so, **values)  # type: ignore[arg-type]


def _check_json(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_schemas_greedy_and_sampled(llm: LLM) -> None:
    names = list(SCHEMAS)
    prompts = [_ask(llm, f"Describe a {name} example as JSON.") for name in names]
    for seed in (None, 1, 2, 3):
        sampled: dict[str, object] = {} if seed is None else {"temperature": 0.8, "seed": seed}
        if seed == 3:  # the filters choose among the allowed tokens too
            sampled |= {"top_k": 40, "top_p": 0.9, "min_p": 0.05}
        params = [_params(StructuredOutputParams(json=SCHEMAS[n]), **sampled) for n in names]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for name, out in zip(names, outs, strict=True):
            assert out.finish_reason == "stop", (seed, name, out.text)
            _check_json(name, out.text)


def test_any_json_object(llm: LLM) -> None:
    so = StructuredOutputParams(json_object=True)
    ask = _ask(llm, 'Answer with a JSON object with one key, "answer": is water wet?')
    out = llm.generate(ask, _params(so), use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    prompts = [
        _ask(llm, "What is the phone number of the office?"),
        _ask(llm, "Is 'I loved this film' positive, negative or neutral?"),
        _ask(llm, "Write an arithmetic expression."),
    ]
    constraints = [
        StructuredOutputParams(regex=PHONE),
        StructuredOutputParams(choice=CHOICES),
        StructuredOutputParams(grammar=ARITHMETIC),
    ]
    for seed in (None, 7, 8):
        sampled = {} if seed is None else {"temperature": 0.8, "seed": seed}
        params = [_params(so, **sampled) for so in constraints]
        phone, choice, expr = llm.generate(prompts, params, use_tqdm=False)
        assert re.fullmatch(PHONE, phone.text), phone.text
        assert choice.text in CHOICES
        # The grammar allows expressions of any length, and greedy as well as
        # sampled ones may run to the limit (the model repeating "10*2+"):
        # a cut one must still be the start of a sentence of the grammar.
        text = expr.text if expr.finish_reason == "stop" else _completed(expr.text)
        assert isinstance(ast.parse(text, mode="eval").body, ast.BinOp | ast.Constant), expr.text
        assert all(re.fullmatch(r"[1-9][0-9]?", n) for n in re.findall(r"[0-9]+", text)), text
        for out in (phone, choice):
            assert out.finish_reason == "stop"


def _completed(prefix: str) -> str:
    """An arithmetic expression cut short, completed: a factor after a
    trailing operator or "(", then the parentheses it left open."""
    assert re.fullmatch(r"[0-9+\-*/()]+", prefix), prefix
    if prefix[-1] in "+-*/(":
        prefix += "1"
    return prefix + ")" * (prefix.count("(") - prefix.count(")"))


def test_free_requests_are_untouched_by_constrained_neighbours(exact_llm: LLM) -> None:
    # The exact path: the fast default's rounding depends on the batch, and a
    # near tie may then flip a greedy token whatever the grammar does.
    llm = exact_llm
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.token_ids for o in llm.generate(FREE, free, use_tqdm=False)]
    constrained = [_params(StructuredOutputParams(json=SCHEMAS[n])) for n in ("person", "array")]
    mixed = llm.generate(
        [FREE[0], _ask(llm, "A person as JSON."), FREE[1], _ask(llm, "Tags as JSON.")],
        [free, constrained[0], free, constrained[1]],
        use_tqdm=False,
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    _check_json("person", mixed[1].text)
    _check_json("array", mixed[3].text)


def test_preemption_and_chunked_prefill_keep_grammars_right(exact_llm: LLM) -> None:
    """Eight constrained requests with long prompts: in 12 blocks some are
    preempted and recomputed; with a 24-token budget every prompt is
    chunked. Greedy outputs equal the unpressured run's. Both engines run
    the exact path: the fast default is not chunk-invariant (README), and a
    near tie moved one request's 28th token in a run of the suite."""
    llm = exact_llm
    names = list(SCHEMAS)[:4] * 2
    prompts = [
        _ask(llm, f"Request {i}. Think about {n} records in a database. Describe one as JSON.")
        for i, n in enumerate(names)
    ]
    params = [_params(StructuredOutputParams(json=SCHEMAS[n]), max_tokens=64) for n in names]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    pressed = LLM(max_model_len=160, num_blocks_override=13, max_num_batched_tokens=24, exact=True)
    outs = pressed.generate(prompts, params, use_tqdm=False)
    assert pressed.totals.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    for name, out in zip(names, outs, strict=True):
        if out.finish_reason == "stop":
            _check_json(name, out.text)


def test_a_constraint_that_does_not_compile_is_an_invalid_request(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputParams(regex="(ab"))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex: .*compile"):
        llm.generate(["Hello", "World"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    # Nothing is left behind: the next call runs alone.
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert out[0].finish_reason == "length"


# Properties listed out of alphabetical order: the output follows the schema.
ORDERED = {
    "type": "object",
    "properties": {
        "zeta": {"type": "integer", "minimum": 0, "maximum": 9},
        "alpha": {"type": "boolean"},
        "mid": {"enum": ["a", "b"]},
    },
    "required": ["zeta", "alpha", "mid"],
    "additionalProperties": False,
}
# Each keyword xgrammar would drop, and where the refusal says it is.
UNENFORCEABLE: list[tuple[dict[str, object], str]] = [
    (
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3},
                "ids": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}},
            },
            "required": ["code", "ids"],
        },
        "properties.code.maxLength",
    ),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "contains"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "maximum": 5}]}, "allOf"),
]


def _keys(text: str) -> list[str]:
    pairs: list[tuple[str, object]] = json.loads(text, object_pairs_hook=list)
    return [k for k, _ in pairs]


def test_an_object_follows_the_schemas_key_order(llm: LLM) -> None:
    so = StructuredOutputParams(json=ORDERED)
    out = llm.generate(_ask(llm, "Answer as JSON."), _params(so, max_tokens=40), use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    assert _keys(out.text) == ["zeta", "alpha", "mid"], out.text


@pytest.mark.parametrize(("schema", "where"), UNENFORCEABLE)
def test_a_keyword_the_backend_would_drop_is_refused(
    llm: LLM, schema: dict[str, object], where: str
) -> None:
    keyword = where.rsplit(".", 1)[-1]
    with pytest.raises(ConstraintError, match=f"'{keyword}'") as info:
        llm.generate("Hi", _params(StructuredOutputParams(json=schema)), use_tqdm=False)
    assert info.value.field == f"structured_outputs.json.{where}"
