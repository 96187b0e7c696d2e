"""GenerateService servicer: validate, tokenize, submit to the scheduler, stream text back;
plus Tokenize, Detokenize, model info and server load.

Bad input fails with INVALID_ARGUMENT before the scheduler sees it; scheduler errors come
back with their own status code; a client that goes away (or whose deadline passes) aborts
the request in the scheduler, which frees its blocks. A sample that ends on a stop string
(found here) is aborted in the scheduler at once. Every request travels on the gateway's
one session stream to its scheduler (`scheduler_session.py`); with several schedulers,
`schedulers.py` picks one per request, and a request that fails with UNAVAILABLE before
anything reached its client is sent once more, to another healthy scheduler. Chat answers
with tools or a reasoning parser are split per sample (`chat_setup.py`, `chat_output.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from common.lifecycle import wait_until
from common.log import bind_request, get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, types_pb2
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.retention import RetentionLimits
from common.sampling import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams
from common.sampling_pb import ROLE_FROM_PB, sampling_to_pb
from common.tracing import end_span, span_trace_id
from services.gateway.beam_check import check_beam_counts, validate_beam_search
from services.gateway.chat_output import ChatParsing, ParserSettings
from services.gateway.chat_setup import ChatSetup
from services.gateway.chat_tools import NONE, ToolRequest, template_messages, validate_functions
from services.gateway.lora_rpcs import LoraRpcs
from services.gateway.metrics import GatewayMetrics, rejected
from services.gateway.output import RequestOutput, SampleOutput
from services.gateway.prompts import LARGE_INPUT_CHARS, PromptTokenizer
from services.gateway.request_trace import GenerateTrace
from services.gateway.scheduler_session import SchedulerError
from services.gateway.schedulers import Schedulers, abort_with, answers
from services.gateway.structured_check import ConstraintChecker
from services.gateway.validation import (
    MAX_DETOKENIZE_IDS,
    InvalidArgumentError,
    ModelLimits,
    NotFoundError,
    Stopping,
    check_prompt_field,
    check_token_ids,
    resolve_max_tokens,
    validate_cache_salt,
    validate_chat,
    validate_count,
    validate_lora_name,
    validate_prompt_ids,
    validate_retention,
    validate_sampling,
    validate_stopping,
    validate_text,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    prompt_ids: list[int]
    stopping: Stopping
    stop_token_ids: frozenset[int]
    n: int
    submit: scheduler_pb2.SubmitRequest
    parsing: ChatParsing | None = None  # how each sample's answer is split


def _ended_by(exc: BaseException, context) -> str:
    """What ended a Generate call, for its span: the status it was aborted with, or why."""
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return f"{getattr(code, 'name', code)}: {context.details()}"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled (the client went away)"
    return repr(exc)


class GenerateServicer(LoraRpcs, generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        tokenizer,
        schedulers: Schedulers,
        default_max_tokens: int,
        allow_runtime_lora_updating: bool = False,
        retention: RetentionLimits = RetentionLimits(),  # noqa: B008 (frozen)
        parsers: ParserSettings | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.tokenizer = tokenizer
        self.prompts = PromptTokenizer(tokenizer, chat_template)
        self.chat = ChatSetup(parsers or ParserSettings(), tokenizer)
        self.schedulers = schedulers
        self.default_max_tokens = default_max_tokens
        self.retention = retention  # kv_retention_s's limit
        self.model: types_pb2.ModelDescription | None = None
        self.limits: ModelLimits | None = None
        # Set on SIGTERM: new requests get UNAVAILABLE, open streams run to the end.
        self.draining = False
        self.num_open = 0

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no Generate stream is open (True) or timeout_s passed (False)."""
        return await wait_until(lambda: not self.num_open, timeout_s)

    def set_model(self, model: types_pb2.ModelDescription) -> None:
        """Start serving `model` (its limits come from the scheduler)."""
        if len(self.tokenizer) > model.vocab_size:
            raise ValueError(
                f"tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary is "
                f"{model.vocab_size}: wrong tokenizer for this model?"
            )
        self.structured = ConstraintChecker(self.tokenizer, model.vocab_size)
        self.limits = ModelLimits(
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            default_max_tokens=self.default_max_tokens,
        )
        self.metrics = GatewayMetrics(model.name)
        self.model = model

    async def _ready(self, context) -> types_pb2.ModelDescription:
        if self.model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the scheduler")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
        return self.model

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LARGE_INPUT_CHARS:
            return await asyncio.to_thread(self.prompts.encode, text, add_special_tokens)
        return self.prompts.encode(text, add_special_tokens)

    async def _prompt_ids(
        self, request: generate_pb2.GenerateRequest, tools: ToolRequest | None = None
    ) -> list[int]:
        which = check_prompt_field(request)
        if which == "text":
            validate_text(request.text, "prompt.text")
            ids, field = await self._encode(request.text), "prompt.text (tokenized)"
        elif which == "token_ids":
            ids, field = list(request.token_ids.ids), "prompt.token_ids.ids"
        else:
            ids = await self._render_chat(request.chat, "prompt.chat", tools)
            field = "prompt.chat (rendered)"
        validate_prompt_ids(ids, self.limits, field)
        return ids

    async def _render_chat(
        self,
        chat: generate_pb2.ChatMessages,
        field: str,
        tools: ToolRequest | None = None,
        answers: bool = True,
    ) -> list[int]:
        """`answers`: every tool turn must answer an earlier call (Generate's rule)."""
        messages = template_messages(chat, validate_chat(chat, field), field, answers)
        go_on = chat.continue_final_message
        add_prompt = (
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not go_on
        )
        args = (messages, add_prompt, field, go_on, tools.template_tools() if tools else None)
        if sum(len(m["content"]) for m in messages) > LARGE_INPUT_CHARS:
            # Rendering and tokenizing megabytes would stall every other call on the loop.
            return await asyncio.to_thread(self.prompts.render_chat, *args)
        return self.prompts.render_chat(*args)

    async def _prepare(
        self, request: generate_pb2.GenerateRequest, request_id: str, trace: GenerateTrace
    ):
        # Cheap checks first: a bad field fails before a large prompt is tokenized.
        check_prompt_field(request)
        sampling = validate_sampling(request.sampling, self.limits)
        n = validate_count(request, "n", 1, MAX_SAMPLES, 1)
        beam = validate_beam_search(request)  # None: sampling
        logprobs = validate_count(request, "logprobs", 0, MAX_LOGPROBS, None)
        prompt_logprobs = validate_count(request, "prompt_logprobs", 0, MAX_LOGPROBS, None)
        cache_salt = validate_cache_salt(request.cache_salt)
        kv_retention_s = validate_retention(request, self.retention)
        tools = self.chat.tools(request)
        forced = await self.chat.forced_calls(tools, self.structured)
        if forced is None and request.HasField("structured_output"):
            await self.structured.check(request.structured_output)
        if request.lora_name and request.lora_name not in self.model.lora_adapters:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the scheduler answers below
                await self.refresh_model()  # loaded since, through another gateway?
        lora_name = validate_lora_name(request.lora_name, list(self.model.lora_adapters))
        tokenize = trace.tokenize_span()
        try:
            prompt_ids = await self._prompt_ids(request, tools)
        finally:
            end_span(tokenize)
        max_tokens = resolve_max_tokens(request, len(prompt_ids), self.limits)
        stopping = validate_stopping(request.stopping, self.limits, max_tokens)
        parsing = self.chat.parsing(
            request, tools, lambda: self.prompts.decode(prompt_ids, skip_special_tokens=False)
        )
        if parsing is not None and parsing.tool_mode and self.chat.keeps_special_tokens(tools):
            stopping = replace(stopping, skip_special_tokens=False)  # as vLLM's hermes
        given = forced or (
            request.structured_output if request.HasField("structured_output") else None
        )
        constraint = self.chat.constraint(given, parsing)
        if constraint is not given:  # after the reasoning: a structural tag, checked too
            await self.structured.check(constraint)
        sampling = replace(
            sampling,
            min_tokens=stopping.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        stop_ids = set(stopping.stop_token_ids)
        if not stopping.ignore_eos:
            stop_ids.update(self.model.eos_token_ids)
        if beam is not None:  # the stop ids are the search's EOS ids; greedy, plain
            check_beam_counts(beam, len(stop_ids))
            sampling = SamplingParams()
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling_to_pb(sampling),
            max_tokens=max_tokens,
            stop_token_ids=sorted(stop_ids),
            cache_salt=cache_salt,
            kv_retention_s=kv_retention_s,
            n=n,
            lora_name=lora_name,
        )
        if beam is not None:
            submit.beam_search.CopyFrom(beam)
        if constraint is not None:  # a forced call's replaces the request's own
            submit.structured_output.CopyFrom(constraint)
        trace.submitted(submit)
        return PreparedRequest(prompt_ids, stopping, frozenset(stop_ids), n, submit, parsing)

    def _output(self, request_id: str, prepared: PreparedRequest, arrival: float):
        samples = [
            SampleOutput(
                index,
                self.tokenizer,
                prepared.prompt_ids,
                prepared.stopping,
                prepared.stop_token_ids,
                self.prompts.token_text,
            )
            for index in range(prepared.n)
        ]
        return RequestOutput(request_id, samples, len(prepared.prompt_ids), arrival)

    async def Generate(self, request, context):
        arrival = time.monotonic()
        if self.model is None or self.draining:
            rejected("UNAVAILABLE")
        model = await self._ready(context)
        trace = GenerateTrace(context, request, model.name)
        self.num_open += 1
        # Server-made, opaque: never taken from the client, never parsed.
        request_id = uuid.uuid4().hex
        try:
            async for message in self._generate(request, context, arrival, trace, request_id):
                yield message
        except BaseException as exc:  # an abort, a client that went away
            trace.end(error=_ended_by(exc, context))
            raise
        else:
            trace.end()
        finally:
            self.num_open -= 1
            self.schedulers.finished(request_id)  # its prompt is no longer in flight

    async def _generate(
        self, request, context, arrival: float, trace: GenerateTrace, request_id: str
    ):
        with bind_request(request_id, span_trace_id(trace.span)):
            try:
                prepared = await self._prepare(request, request_id, trace)
            except InvalidArgumentError as exc:
                log.info("invalid_request", error=str(exc))
                rejected("INVALID_ARGUMENT")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except NotFoundError as exc:
                log.info("unknown_lora_adapter", error=str(exc))
                rejected("NOT_FOUND")
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            backend, tried = self.schedulers.pick(prepared.submit), ()
            while True:
                if backend is None:
                    rejected("UNAVAILABLE")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler available")
                tried += (backend,)
                output = trace.output = self._output(request_id, prepared, arrival)
                chat = (
                    [prepared.parsing.sample() for _ in range(prepared.n)]
                    if (prepared.parsing)
                    else None
                )
                updates = await backend.session.submit(prepared.submit)
                sent = False
                try:
                    async for update in updates:
                        times = output.samples[update.index].times
                        previous_last = times.last
                        message = output.consume(update, self.prompts.token_text)
                        if message is None:
                            continue  # a sample that already ended on a stop string
                        if chat is not None:
                            chat[message.index].rewrite(message)
                        self.metrics.message(times, previous_last)
                        if output.done:
                            self.metrics.finished(output, message)
                        sent = True
                        yield message
                        if output.done:
                            break
                        if message.HasField("stop_string"):  # the other samples go on
                            await updates.abort(message.index)
                except SchedulerError as exc:
                    retry = None
                    if exc.code == grpc.StatusCode.UNAVAILABLE and not sent:
                        retry = self.schedulers.pick(prepared.submit, exclude=tried)
                    if retry is None:
                        log.warning("scheduler_error", code=exc.code.name, details=exc.details)
                        if not sent:  # refused (queue full, unknown adapter, ...), not midway
                            rejected(exc.code.name)
                        await context.abort(exc.code, exc.details)
                    log.warning(
                        "retrying_on_another_scheduler",
                        failed=backend.address,
                        retry=retry.address,
                        details=exc.details,
                    )
                    backend = retry
                    continue
                finally:
                    updates.close()  # no-op when finished; aborts it if the client left
                break
            if not output.done:
                await context.abort(grpc.StatusCode.INTERNAL, "the scheduler stream ended early")

    async def Tokenize(self, request, context):
        m = await self._ready(context)
        try:
            which = request.WhichOneof("input")
            if which is None:
                raise InvalidArgumentError("input is required: set text or chat")
            if which == "text":
                if request.tools:
                    raise InvalidArgumentError("tools need chat (the chat template renders them)")
                validate_text(request.text, "text", allow_empty=True)
                add_special = (
                    request.add_special_tokens if request.HasField("add_special_tokens") else True
                )
                ids = await self._encode(request.text, add_special)
            else:
                functions = validate_functions(request.tools)
                tools = ToolRequest(functions, NONE) if functions else None
                ids = await self._render_chat(request.chat, "chat", tools, answers=False)
        except InvalidArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generate_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.prompts.pieces(ids), max_model_len=m.max_model_len
        )

    async def Detokenize(self, request, context):
        await self._ready(context)
        ids = list(request.token_ids)
        try:
            if len(ids) > MAX_DETOKENIZE_IDS:
                raise InvalidArgumentError(
                    f"token_ids must hold at most {MAX_DETOKENIZE_IDS} ids, got {len(ids)}"
                )
            check_token_ids(ids, self.limits, "token_ids")
        except InvalidArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return generate_pb2.DetokenizeResponse(text=self.prompts.decode(ids, skip))

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients use for the model (--served-model-name), the first the main
        one; by default the scheduler's (the model folder's name)."""
        return self.served_model_names or (self.model.name,)

    def _model_info(self, name: str | None = None) -> generate_pb2.GetModelInfoResponse:
        m = self.model
        return generate_pb2.GetModelInfoResponse(
            model_name=name or self.model_names[0],
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            eos_token_ids=list(m.eos_token_ids),
            dtype=m.dtype,
            has_chat_template=self.prompts.has_chat_template,
            lora_adapters=list(m.lora_adapters),
        )

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        return self._model_info()

    async def ListModels(self, request, context):
        await self._ready(context)
        return generate_pb2.ListModelsResponse(
            models=[self._model_info(name) for name in self.model_names]
        )

    async def GetServerLoad(self, request, context):
        """Summed over the schedulers that answer (one scheduler: its error if it fails)."""
        await self._ready(context)
        timeout = context.time_remaining() or 10.0
        replies = await self.schedulers.call_all(
            lambda b: b.stub.GetPoolStats(scheduler_pb2.GetPoolStatsRequest(), timeout=timeout)
        )
        answered = answers(replies)
        if not answered:
            await abort_with(context, replies[0][1] if replies else None)
        pools = [p for stats in answered for p in stats.pools]
        total = sum(p.num_blocks for p in pools)
        used = sum(p.num_blocks - p.num_free_blocks for p in pools)
        return generate_pb2.GetServerLoadResponse(
            num_requests=sum(stats.num_requests for stats in answered),
            kv_cache_usage=used / total if total else 0.0,
            workers=[
                generate_pb2.WorkerLoad(
                    worker_id=p.worker_id,
                    role=ROLE_FROM_PB.get(p.role, "unknown"),
                    num_requests=p.num_requests,
                    num_blocks=p.num_blocks,
                    num_free_blocks=p.num_free_blocks,
                )
                for p in pools
            ],
        )
