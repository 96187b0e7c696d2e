"""vLLM's extras in the HTTP front's translation, without a network: `/tokenize` and
`/detokenize` bodies and answers, `return_token_ids` (prompt and generated ids on choices,
chunks and chat answers) and `return_tokens_as_token_ids` (logprob tokens as
`token_id:<id>`)."""

from __future__ import annotations

import pytest

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_request import parse_chat
from services.openai_api.chat_response import ChatChunks, chat_body
from services.openai_api.collect import Collector, Meta
from services.openai_api.completion_request import parse_completion
from services.openai_api.completion_response import CompletionChunks, completion_body
from services.openai_api.errors import ApiError
from services.openai_api.logprobs import chat_logprobs, completion_logprobs
from services.openai_api.tokenize_request import (
    check_vocabulary,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)

META = Meta("cmpl-abc", 1700000000, "tiny")
STOP = generate_pb2.FINISH_REASON_STOP


def message(index=0, text="", ids=(), finish=0, logprobs=()):
    return generate_pb2.GenerateResponse(
        request_id="abc", index=index, text=text, token_ids=list(ids), finish_reason=finish,
        logprobs=list(logprobs),
    )  # fmt: skip


def lp(token_id, token, tops=()):
    return generate_pb2.TokenLogprob(
        token_id=token_id, token=token, logprob=-0.5,
        top_logprobs=[generate_pb2.TopLogprob(token_id=i, token=t, logprob=-1.0) for i, t in tops],
    )  # fmt: skip


def rejected(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    return info.value


def test_tokenize_forms_and_vllms_defaults():
    text = parse_tokenize({"model": "tiny", "prompt": "Hi"})
    assert text.model == "tiny" and not text.return_token_strs
    assert text.request.text == "Hi" and text.request.add_special_tokens is True
    text = parse_tokenize({"prompt": "", "add_special_tokens": False, "return_token_strs": True})
    assert text.request.text == "" and text.request.HasField("add_special_tokens")
    assert text.request.add_special_tokens is False and text.return_token_strs

    chat = parse_tokenize(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]}
    )
    assert [(m.role, m.content) for m in chat.request.chat.messages] == [("system", "a")]
    # Unset: the gateway's default (true, as vLLM's), false when continuing the last message.
    assert not chat.request.chat.HasField("add_generation_prompt")
    assert not chat.request.chat.continue_final_message
    assert not chat.request.HasField("add_special_tokens")  # the template places them
    chat = parse_tokenize({
        "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False,
        "continue_final_message": False, "add_special_tokens": False,
        "chat_template_kwargs": {}, "tools": [], "return_token_strs": False,
    })  # fmt: skip
    assert chat.request.chat.add_generation_prompt is False
    for parse, body in (
        (parse_tokenize, {"messages": [{"role": "user", "content": "x"}]}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        parsed = parse({**body, "continue_final_message": True})
        chat = parsed.request.chat
        assert chat.continue_final_message and not chat.HasField("add_generation_prompt")
        error = rejected(
            parse, {**body, "continue_final_message": True, "add_generation_prompt": True}
        )
        assert error.param == "continue_final_message" and "add_generation_prompt" in error.message


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": ["a"]}, "prompt", "must be a string, got array"),
        ({"prompt": "a", "messages": []}, "messages", "not both"),
        ({"prompt": "a", "tools": []}, "tools", "unknown"),
        ({"messages": "hi"}, "messages", "non-empty array"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": None}, "messages", "not both"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
         "chat_template_kwargs", "must be an object"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": "no"},
         "continue_final_message", "must be a boolean"),
        ({"model": 3, "prompt": "a"}, "model", "must be a string"),
        ([], "the request body", "JSON object"),
    ],
)  # fmt: skip
def test_tokenize_bad_bodies_are_400s_naming_the_field(body, param, words):
    error = rejected(parse_tokenize, body)
    assert error.status == 400 and error.param == param and words in error.message


def test_tokenize_answer_is_vllms_shape():
    reply = generate_pb2.TokenizeResponse(token_ids=[1, 7], tokens=["<s>", "Hi"], max_model_len=64)
    assert tokenize_body(reply, False) == {
        "count": 2, "max_model_len": 64, "tokens": [1, 7], "token_strs": None,
    }  # fmt: skip
    assert tokenize_body(reply, True)["token_strs"] == ["<s>", "Hi"]


def test_detokenize_body_and_the_vocabulary_check():
    call = parse_detokenize({"model": "tiny", "tokens": [0, 5]})
    assert (call.model, call.tokens) == ("tiny", (0, 5))
    assert parse_detokenize({"tokens": []}).tokens == ()
    assert rejected(parse_detokenize, {"tokens": "12"}).param == "tokens"
    assert rejected(parse_detokenize, {"tokens": [1.5]}).param == "tokens[0]"
    assert rejected(parse_detokenize, {"tokens": [1], "prompt": "x"}).param == "prompt"
    check_vocabulary([0, 99], 100)
    with pytest.raises(ApiError) as info:
        check_vocabulary([0, 100, -1], 100)
    assert info.value.param == "tokens[1]" and "[0, 100)" in info.value.message


def test_token_id_extras_are_read_by_both_endpoints_and_default_off():
    for parse, body in (
        (parse_completion, {"prompt": "x"}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        options = parse(body).options
        assert not options.return_token_ids and not options.tokens_as_ids
        options = parse({**body, "return_token_ids": True, "return_tokens_as_token_ids": True})
        assert options.options.return_token_ids and options.options.tokens_as_ids
        error = rejected(parse, {**body, "return_token_ids": 1})
        assert error.param == "return_token_ids" and "must be a boolean" in error.message


def test_completion_token_ids_on_choices_and_chunks():
    collector = Collector(n=1)
    for prompt_index, ids in ((0, (5, 6)), (1, (7,))):
        collector.add(prompt_index, message(text="ab", ids=ids, finish=STOP))
    body = completion_body(META, collector, None, False, False, prompt_ids=[[1, 2], [3]])
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in body["choices"]] == [
        ([1, 2], [5, 6]), ([3], [7]),
    ]  # fmt: skip
    plain = completion_body(META, collector, None, False, False)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    chunks = CompletionChunks(META, 1, None, False, False, prompt_ids=[[1, 2]])
    assert chunks.chunk(0, message()) is None  # nothing to send: the prompt ids wait
    first = chunks.chunk(0, message(text="a", ids=[5]))["choices"][0]
    second = chunks.chunk(0, message(text="", ids=[6], finish=STOP))["choices"][0]
    assert (first["prompt_token_ids"], first["token_ids"]) == ([1, 2], [5])
    assert "prompt_token_ids" not in second and second["token_ids"] == [6]


def test_chat_token_ids_on_the_answer_and_chunks():
    collector = Collector(n=1)
    collector.add(0, message(text="ok", ids=[5, 6], finish=STOP))
    body = chat_body(META, collector, False, False, prompt_ids=[1, 2, 3])
    assert body["prompt_token_ids"] == [1, 2, 3] and body["choices"][0]["token_ids"] == [5, 6]
    assert "prompt_token_ids" not in chat_body(META, collector, False, False)

    chunks = ChatChunks(META, 2, False, False, prompt_ids=[1, 2])
    role = chunks.role_chunks()
    assert role[0]["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in role[1]
    assert all("token_ids" not in c["choices"][0] for c in role)  # they cover no token
    chunk = chunks.chunk(message(index=1, text="x", ids=[9]))
    assert chunk["choices"][0]["token_ids"] == [9] and "prompt_token_ids" not in chunk


def test_return_tokens_as_token_ids_renders_tokens_and_top_keys():
    entries = [lp(7, "é", tops=[(7, "é"), (8, "e")]), lp(9, "ab")]
    body, offset = completion_logprobs(entries, 3, as_ids=True)
    assert body["tokens"] == ["token_id:7", "token_id:9"]
    assert body["top_logprobs"] == [{"token_id:7": -1.0, "token_id:8": -1.0}, {}]
    assert body["text_offset"] == [3, 4] and offset == 6  # offsets count the real text
    (first, _) = chat_logprobs(entries, as_ids=True)
    assert first["token"] == "token_id:7" and first["bytes"] == list(b"token_id:7")
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:7", "token_id:8"]
    assert chat_logprobs(entries)[0]["token"] == "é"  # off: the token's text
