"""Structured output and beam search on real prompts, through a running stack.

Structured output: 14 JSON schemas of the shapes API users send (a person, a letter, an
order with items, an event, a product review, a recipe, a support ticket, tool-call
arguments, ...), each with a chat prompt whose answer is in the prompt (mostly the
held-out text's paragraphs) or asks the model to make one up; greedy. Every output is
parsed and validated with `jsonschema` (formats checked), then checked for values that
are typed and non-empty: no empty or whitespace-only string, array or object anywhere.

Beam search: k = 4 (all 4 hypotheses returned) on 4 chat prompts, against HF's
`generate(num_beams=4, do_sample=False)` in fp32 (`tests.hf_reference.hf_beam_search`):
tokens equal hypothesis for hypothesis, scores to 1e-4.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema

from bench.quality_ppl import paragraphs
from bench.quality_spec import chat_ids
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

STRUCTURED_MAX_TOKENS = 384


def _s(**kw) -> dict:
    return {"type": "string", **kw}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}  # fmt: skip


def _arr(items: dict, **kw) -> dict:
    return {"type": "array", "items": items, **kw}


def structured_cases() -> list[dict]:
    """[{name, schema, prompt}], prompts built on the held-out paragraphs where one fits."""
    texts = paragraphs()

    def para(start: str) -> str:
        return next(q for q in texts if q.startswith(start))

    cases = [
        ("person", _obj({"name": _s(), "age": {"type": "integer"}, "occupation": _s(),
                         "town": _s()}),
         "Describe the man who came to run the mill as JSON (his name, his age when he "
         f"arrived, his occupation and the town).\n\n{para('Ketteridge was thirty-one')}"),
        ("letter", _obj({"sender": _s(), "recipient": _s(), "place": _s(), "date": _s(
            format="date"), "summary": _s()}),
         "Give this letter's sender, recipient, the place it was written, its date "
         f"(YYYY-MM-DD) and a one-sentence summary as JSON.\n\n{para('Port Elric, 30 April')}"),
        ("event", _obj({"name": _s(), "town": _s(), "founded_year": {"type": "integer"},
                        "founders": _arr(_s(), minItems=1, maxItems=4),
                        "schedule": _s()}),
         f"Describe this event as JSON.\n\n{para('On the second Sunday')}"),
        ("order", _obj({"customer": _s(), "items": _arr(_obj({"name": _s(),
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number"}}), minItems=1, maxItems=6),
                        "total": {"type": "number"}}),
         "Turn this order into JSON: Maria Lopez orders two loaves of rye bread at 3.50 "
         "each, one jar of heather honey at 6.00 and three bags of flour at 1.20 each. "
         "The total is 16.60."),
        ("review", _obj({"product": _s(), "rating": {"type": "integer", "minimum": 1,
                         "maximum": 5}, "pros": _arr(_s(), maxItems=4),
                         "cons": _arr(_s(), maxItems=4), "would_recommend": {"type": "boolean"}}),
         "Write a short product review of a two-slice toaster as JSON."),
        ("weather", _obj({"city": _s(), "temperature_c": {"type": "number"},
                          "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                          "wind_kph": {"type": "number"}}),
         "Report this as JSON: in Oslo it is 4 degrees Celsius with light rain and a "
         "wind of 20 km/h."),
        ("recipe", _obj({"title": _s(), "servings": {"type": "integer"},
                         "ingredients": _arr(_obj({"item": _s(), "amount": _s()}),
                                             minItems=1, maxItems=8),
                         "steps": _arr(_s(), minItems=1, maxItems=6)}),
         "Give a simple recipe for pancakes as JSON."),
        ("book", _obj({"title": _s(), "author": _s(), "year": {"type": "integer"},
                       "genres": _arr(_s(), maxItems=3)}),
         "Describe the novel Pride and Prejudice as JSON."),
        ("ticket", _obj({"customer_name": _s(), "category": {"enum": ["billing", "delivery",
                         "technical", "other"]}, "priority": {"enum": ["low", "medium",
                         "high"]}, "description": _s()}),
         "Make a support ticket as JSON from this email: 'Hello, this is Tom Baker. My "
         "parcel was supposed to arrive on Monday and it still has not come. Please help "
         "quickly, I need it for a wedding on Saturday.'"),
        ("tool_call", {"type": "object", "properties": {
            "name": {"enum": ["get_weather", "search_web", "send_email", "create_event"]},
            "arguments": _obj({"location": _s(), "unit": {"enum": ["celsius", "fahrenheit"]}})},
            "required": ["name", "arguments"], "additionalProperties": False},
         "Call the right tool, as JSON, to answer: what is the weather in Lisbon right now, "
         "in celsius?"),
        ("contact", _obj({"name": _s(), "email": _s(format="email"), "phone": _s(),
                          "city": _s()}),
         "Extract the contact details as JSON: 'You can reach Dr. Helen Okafor at "
         "helen.okafor@example.org or on 555-0142; she works in Leeds.'"),
        ("job", _obj({"title": _s(), "company": _s(), "remote": {"type": "boolean"},
                      "salary_min": {"type": "integer"}, "salary_max": {"type": "integer"},
                      "skills": _arr(_s(), minItems=1, maxItems=5)}),
         "Write a job posting for a junior baker at a village mill as JSON."),
        ("steps", _obj({"tool": _s(), "steps": _arr(_s(), minItems=1, maxItems=6),
                        "largest_turn": _s()}),
         f"Summarise these instructions as JSON.\n\n{para('Each spoke pulls the rim')}"),
        ("facts", _obj({"peak_colony_size": {"type": "integer"},
                        "swarming_months": _arr(_s(), minItems=1, maxItems=4),
                        "inspection_interval_days": _s()}),
         f"Pull these facts out of the text as JSON.\n\n{para('A colony changes with')}"),
    ]  # fmt: skip
    return [{"name": n, "schema": s, "prompt": q} for n, s, q in cases]


def empty_values(value, path: str = "$") -> list[str]:
    """Paths of empty or whitespace-only strings, empty arrays and empty objects."""
    if isinstance(value, str):
        return [path] if not value.strip() else []
    if isinstance(value, list):
        out = [path] if not value else []
        for i, item in enumerate(value):
            out += empty_values(item, f"{path}[{i}]")
        return out
    if isinstance(value, dict):
        out = [path] if not value else []
        for key, item in value.items():
            out += empty_values(item, f"{path}.{key}")
        return out
    return []


def _generate(stub, request) -> tuple[list[int], str, str]:
    tokens, text, reason = [], "", ""
    for message in stub.Generate(request, timeout=900):
        tokens.extend(message.token_ids)
        text += message.text
        if message.finish_reason:
            reason = generate_pb2.FinishReason.Name(message.finish_reason)
    return tokens, text, reason


def structured(address: str, tokenizer) -> dict:
    cases = structured_cases()
    checker = jsonschema.FormatChecker()

    def one(case: dict) -> dict:
        request = generate_pb2.GenerateRequest(max_tokens=STRUCTURED_MAX_TOKENS)
        request.token_ids.ids.extend(chat_ids(tokenizer, case["prompt"]))
        request.sampling.temperature = 0.0
        request.structured_output.json_schema = json.dumps(case["schema"])
        with grpc.insecure_channel(address) as channel:
            tokens, text, reason = _generate(generate_pb2_grpc.GenerateServiceStub(channel),
                                             request)  # fmt: skip
        row = {"name": case["name"], "finish_reason": reason, "tokens": len(tokens),
               "text": text}  # fmt: skip
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            return row | {"valid": False, "error": f"not JSON: {error}"}
        errors = [e.message for e in jsonschema.Draft202012Validator(
            case["schema"], format_checker=checker).iter_errors(value)]  # fmt: skip
        empties = empty_values(value)
        return row | {"valid": not errors, "errors": errors, "empty": empties,
                      "typed_and_non_empty": not errors and not empties}  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(one, cases))
    n = len(rows)
    return {
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "schemas": {c["name"]: c["schema"] for c in cases},
        "results": rows,
        "valid": sum(r["valid"] for r in rows),
        "typed_and_non_empty": sum(r.get("typed_and_non_empty", False) for r in rows),
        "count": n,
    }


BEAM_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for keeping bees in a small garden.",
    "Write one sentence about a lighthouse at night.",
    "Explain in two sentences how a water mill grinds flour.",
)
BEAM_WIDTH, BEAM_MAX_TOKENS = 4, 48


def beam(address: str, folder: Path, tokenizer) -> dict:
    from tests.hf_reference import hf_beam_search

    eos = [tokenizer.eos_token_id]
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for prompt in BEAM_PROMPTS:
            ids = chat_ids(tokenizer, prompt)
            request = generate_pb2.GenerateRequest(max_tokens=BEAM_MAX_TOKENS, n=BEAM_WIDTH)
            request.token_ids.ids.extend(ids)
            request.beam_search.beam_width = BEAM_WIDTH
            got: dict[int, dict] = {}
            for message in stub.Generate(request, timeout=900):
                hyp = got.setdefault(message.index, {"tokens": [], "score": None})
                hyp["tokens"].extend(message.token_ids)
                if message.HasField("beam_score"):
                    hyp["score"] = message.beam_score
            ref = hf_beam_search(folder, ids, num_beams=BEAM_WIDTH,
                                 max_new_tokens=BEAM_MAX_TOKENS, eos_token_ids=eos,
                                 num_return_sequences=BEAM_WIDTH)  # fmt: skip
            ours = [got.get(i, {"tokens": [], "score": None}) for i in range(BEAM_WIDTH)]
            tokens_equal = [o["tokens"] == list(t) for o, (t, _) in zip(ours, ref, strict=True)]
            pairs = list(zip(ours, ref, strict=True))
            score_diff = max(abs((o["score"] or 0.0) - s) for o, (_, s) in pairs)
            rows.append({
                "prompt": prompt, "tokens_equal": tokens_equal,
                "max_score_diff": round(score_diff, 7),
                "exact": all(tokens_equal) and score_diff <= 1e-4,
                "best_text": tokenizer.decode(ours[0]["tokens"], skip_special_tokens=True),
            })  # fmt: skip
    return {"beam_width": BEAM_WIDTH, "max_tokens": BEAM_MAX_TOKENS, "results": rows,
            "exact": sum(r["exact"] for r in rows), "count": len(rows)}  # fmt: skip
