"""Tandem behind the field's gateway: a real `smg` (through `tandem gateway`)
in front of the session's `tandem serve`, driven with the `openai` client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerBase

from service.client import TandemClient
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.gateway import MODEL, SmgGateway
from tests.integration.servers import ROOT, ServerProcess, launched

QUESTION = "What is the capital of France?"
# --chat-template's: turns as "role: content" lines, no ChatML markers.
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def gateway(server: ServerProcess) -> Iterator[SmgGateway]:
    with SmgGateway(workers=[server.target]) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: SmgGateway) -> openai.OpenAI:
    return gateway.openai(timeout=120.0)


@pytest.fixture(scope="module")
def templated_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A pod serving with --chat-template (a file), started beside the tests before it."""
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(PLAIN)
    pod = ServerProcess(["--chat-template", str(path), "--max-num-seqs", "4"])
    with launched(pod):
        yield pod


def _chat(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    params: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
        **kwargs,
    }
    return client.chat.completions.create(**params)  # type: ignore[call-overload,no-any-return]


def _status(server: ServerProcess) -> tuple[int, int, float]:
    async def go() -> tuple[int, int, float]:
        async with TandemClient(server.target) as c:
            s = await c.status()
            return s.num_running, s.num_waiting, s.kv_cache_usage

    return asyncio.run(go())


def test_greedy_chat_is_what_tandem_generate_answers(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """smg renders the chat template and tokenizes itself: the same tokens
    reach the engine as through tandem.v1's chat input."""
    got = _chat(client)
    flags = ["--server", server.target, "--max-tokens", "24", "--temperature", "0"]
    cli = subprocess.run(
        [sys.executable, "-m", "service.cli", "generate", "--chat", QUESTION, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert got.choices[0].message.content == cli.stdout.strip()
    assert got.choices[0].finish_reason == "stop"
    usage = got.usage
    assert usage is not None and usage.prompt_tokens > 20
    assert 0 < (usage.completion_tokens or 0) <= 24


def test_a_streamed_chat_is_the_same_text_with_usage_last(client: openai.OpenAI) -> None:
    whole = _chat(client).choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    usage = None
    finish = None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole
    assert finish == "stop"
    # Asked again, the prompt's KV is in the prefix cache.
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 16


def test_completion_max_tokens_stop_and_seed(client: openai.OpenAI) -> None:
    long = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=7, temperature=0
    )
    assert long.choices[0].finish_reason == "length"
    assert long.usage is not None and long.usage.completion_tokens == 7
    stopped = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == " 4, 5,"
    seeded = [
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.2, seed=s
        ).choices[0]
        for s in (11, 11, 12)
    ]
    assert seeded[0].text == seeded[1].text
    assert seeded[0].text != seeded[2].text


def test_n_choices_share_the_prompt_and_differ(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.2, n=3, seed=5
    )
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(got.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert got.usage is not None and got.usage.completion_tokens == 30


def test_logprobs_come_back_per_token(client: openai.OpenAI) -> None:
    got = _chat(client, max_tokens=5, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == got.usage.completion_tokens  # type: ignore[union-attr]
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
    # Greedy: the sampled token is the most likely one.
    assert all(t.token == t.top_logprobs[0].token for t in content)


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_response_format_constrains_the_answer(client: openai.OpenAI) -> None:
    """OpenAI's response_format reaches the engine as vLLM's constraint."""
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    got = _chat(client, max_tokens=64, response_format=schema).choices[0]
    assert got.finish_reason == "stop", got.message.content
    jsonschema.validate(json.loads(got.message.content or ""), CITY)
    got = _chat(client, max_tokens=64, response_format={"type": "json_object"}).choices[0]
    assert got.finish_reason == "stop", got.message.content
    assert isinstance(json.loads(got.message.content or ""), dict)


def test_invalid_argument_is_http_400_naming_the_field(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 12}}}
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, response_format=bad)
    assert "structured_outputs.json" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        _chat(client, temperature=-1)


def test_the_answer_follows_the_schemas_key_order(client: openai.OpenAI) -> None:
    """smg passes the schema on as it came: an object's keys in its order."""
    schema = {
        "type": "object",
        "properties": {
            "zeta": {"type": "boolean"},
            "alpha": {"type": "boolean"},
            "mid": {"enum": [1, 2]},
        },
        "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False,
    }
    format_ = {"type": "json_schema", "json_schema": {"name": "ordered", "schema": schema}}
    got = _chat(client, max_tokens=48, response_format=format_).choices[0]
    assert got.finish_reason == "stop", got.message.content
    pairs = json.loads(got.message.content or "", object_pairs_hook=list)
    assert [k for k, _ in pairs] == ["zeta", "alpha", "mid"], got.message.content


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "array", "items": {}, "contains": {"const": 7}}, "contains"),
        ({"type": "object", "properties": {"n": {"not": {"const": 3}}}}, "properties.n.not"),
        ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, "allOf"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength"),
    ],
)
def test_a_keyword_the_engine_cannot_enforce_is_http_400_naming_it(
    client: openai.OpenAI, schema: dict[str, object], where: str
) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, response_format=format_)
    keyword = where.rsplit(".", 1)[-1]
    assert f"sampling_params.json_schema.{where}: '{keyword}'" in str(err.value), err.value


def test_a_client_disconnect_aborts_the_request(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Write a very long story about a dragon.",
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _ in enumerate(stream, 1):
        if received == 3:
            break
    assert _status(server)[0] >= 1  # still generating on the pod
    stream.close()
    deadline = time.monotonic() + 30
    while _status(server) != (0, 0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _status(server) == (0, 0, 0.0)  # aborted, and its blocks are back


def test_logit_bias_and_penalties_reach_the_engine(client: openai.OpenAI) -> None:
    prompt = "Count: 1, 1, 1, 1, 1, 1,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={"314": 100}
    )
    penalized = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        frequency_penalty=2.0,
        extra_body={"repetition_penalty": 1.5, "min_p": 0.05},
    )
    assert forced.usage is not None and forced.usage.completion_tokens == 4
    assert len(set(forced.choices[0].text.split())) <= 1  # one token, four times
    assert forced.choices[0].text != plain.choices[0].text
    assert penalized.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, frequency_penalty=3)


def test_the_gateway_renders_with_the_pods_chat_template(
    templated_pod: ServerProcess, tokenizer: PreTrainedTokenizerBase
) -> None:
    """smg takes the template from the pod's tokenizer archive: its prompt is
    PLAIN's rendering, token for token the one Tandem's own chat input makes,
    and the answer is the same."""
    rendered = f"user: {QUESTION}\nassistant:"
    own = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=True, add_generation_prompt=True
    )
    with templated_pod, SmgGateway(workers=[templated_pod.target]) as gw:
        got = _chat(gw.openai(timeout=120.0))

        async def tandem_chat() -> list[pb.GenerateResponse]:
            async with TandemClient(templated_pod.target) as c:
                messages = [{"role": "user", "content": QUESTION}]
                stream = c.generate(messages=messages, max_tokens=24, temperature=0.0)
                return [chunk async for chunk in stream]

        chunks = asyncio.run(tandem_chat())
    assert got.usage is not None
    assert got.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert got.usage.prompt_tokens == len(tokenizer.encode(rendered)) != len(own)
    assert got.choices[0].message.content == "".join(c.text for c in chunks)
