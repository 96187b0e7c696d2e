"""GenerateService servicer: validate, tokenize, submit to the scheduler, stream text back.

Bad input fails with INVALID_ARGUMENT before the scheduler sees it; scheduler errors come
back with their own status code; a client that goes away cancels the scheduler stream,
which aborts the request and frees its blocks.
"""

from __future__ import annotations

import uuid

import grpc

from common.log import bind_request, get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.validation import (
    InvalidArgumentError,
    ModelLimits,
    check_prompt_field,
    resolve_max_tokens,
    validate_cache_salt,
    validate_prompt_ids,
    validate_prompt_text,
    validate_sampling,
)

log = get_logger(__name__)

FINISH_FROM_PB = {
    types_pb2.FINISH_REASON_STOP: generate_pb2.FINISH_REASON_STOP,
    types_pb2.FINISH_REASON_LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    types_pb2.FINISH_REASON_ABORT: generate_pb2.FINISH_REASON_ABORT,
}


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        tokenizer,
        scheduler: scheduler_pb2_grpc.SchedulerServiceStub,
        default_max_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.default_max_tokens = default_max_tokens
        self.model: types_pb2.ModelDescription | None = None
        self.limits: ModelLimits | None = None

    def set_model(self, model: types_pb2.ModelDescription) -> None:
        """Start serving `model` (its limits come from the scheduler)."""
        if len(self.tokenizer) > model.vocab_size:
            raise ValueError(
                f"tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary is "
                f"{model.vocab_size}: wrong tokenizer for this model?"
            )
        self.limits = ModelLimits(
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            default_max_tokens=self.default_max_tokens,
        )
        self.model = model

    async def _ready(self, context) -> types_pb2.ModelDescription:
        if self.model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the scheduler")
        return self.model

    def _prepare(self, request: generate_pb2.GenerateRequest, request_id: str):
        which = check_prompt_field(request)
        if which == "text":
            validate_prompt_text(request.text)
            prompt_ids = self.tokenizer.encode(request.text)
            validate_prompt_ids(prompt_ids, self.limits, "prompt.text (tokenized)")
        else:
            prompt_ids = list(request.token_ids.ids)
            validate_prompt_ids(prompt_ids, self.limits, "prompt.token_ids.ids")
        sampling = validate_sampling(request.sampling)
        max_tokens = resolve_max_tokens(request, len(prompt_ids), self.limits)
        return prompt_ids, scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=types_pb2.SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
            ),
            max_tokens=max_tokens,
            stop_token_ids=list(self.model.eos_token_ids),
            cache_salt=validate_cache_salt(request.cache_salt),
        )

    async def Generate(self, request, context):
        await self._ready(context)
        request_id = uuid.uuid4().hex
        with bind_request(request_id):
            try:
                prompt_ids, submit = self._prepare(request, request_id)
            except InvalidArgumentError as exc:
                log.info("invalid_request", error=str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            timeout = context.time_remaining()
            call = self.scheduler.Submit(submit, timeout=timeout)
            try:
                async for update in call:
                    text = detokenizer.add(update.token_ids)
                    response = generate_pb2.GenerateResponse(
                        request_id=request_id, token_ids=update.token_ids
                    )
                    if update.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED:
                        text += detokenizer.flush()
                        response.finish_reason = FINISH_FROM_PB[update.finish_reason]
                        response.usage.CopyFrom(
                            generate_pb2.Usage(
                                prompt_tokens=update.usage.prompt_tokens,
                                completion_tokens=update.usage.completion_tokens,
                                cached_tokens=update.usage.cached_tokens,
                            )
                        )
                    response.text = text
                    yield response
            except grpc.aio.AioRpcError as exc:
                log.warning("scheduler_error", code=exc.code().name, details=exc.details())
                await context.abort(exc.code(), exc.details() or "scheduler error")
            finally:
                call.cancel()  # no-op when finished; aborts the request if the client left

    async def GetModelInfo(self, request, context):
        m = await self._ready(context)
        return generate_pb2.GetModelInfoResponse(
            model_name=m.name,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            eos_token_ids=list(m.eos_token_ids),
            dtype=m.dtype,
        )
