"""Domain objects (stepahead.plan) ⇄ protobuf messages (stepahead.v1).

Servicers stay thin: they call these converters and hand domain objects to domain code.
"""

from __future__ import annotations

import dataclasses

from stepahead.flight_recorder import StepRecord
from stepahead.logprobs import MAX_LOGPROBS, Logprobs, PromptLogprobs
from stepahead.plan import (
    FinishReason,
    NewRequest,
    RunningRequest,
    SamplingParams,
    SpecOutcome,
    StepPlan,
    StepResult,
    StructuredKind,
    StructuredOutput,
    WorkerInfo,
    WorkerTiming,
)
from stepahead.v1 import common_pb2, scheduler_pb2


_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for UNSPECIFIED (still running); ValueError for a value this build does not know."""
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown finish_reason {value}") from None


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        logit_bias=dict(p.logit_bias),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.structured is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(p.structured))
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


_STRUCTURED_TEXT_FIELDS = {StructuredKind.JSON_SCHEMA: "json", StructuredKind.REGEX: "regex",
                           StructuredKind.GRAMMAR: "grammar"}
_STRUCTURED_FROM_FIELD = {v: k for k, v in _STRUCTURED_TEXT_FIELDS.items()}


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutputs:
    if s.kind is StructuredKind.JSON_OBJECT:
        return common_pb2.StructuredOutputs(json_object=True)
    if s.kind is StructuredKind.CHOICE:
        return common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=s.choices))
    return common_pb2.StructuredOutputs(**{_STRUCTURED_TEXT_FIELDS[s.kind]: s.spec})


def structured_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    """None when `structured_outputs` is unset or holds no constraint (`json_object: false` included)."""
    if not msg.HasField("structured_outputs"):
        return None
    so = msg.structured_outputs
    which = so.WhichOneof("constraint")
    if which is None or (which == "json_object" and not so.json_object):
        return None
    if which == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if which == "choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(so.choice.choices))
    return StructuredOutput(_STRUCTURED_FROM_FIELD[which], spec=getattr(so, which))


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Proto → domain. Unset temperature/top_p mean 1; unset max_tokens means the default."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        structured=structured_from_proto(msg),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def logprobs_to_proto(lp: Logprobs) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                               top_logprobs=[v for _, v in lp.top])


def logprobs_from_proto(msg: common_pb2.Logprobs) -> Logprobs:
    if len(msg.top_token_ids) != len(msg.top_logprobs):
        raise ValueError(f"logprobs: {len(msg.top_token_ids)} top_token_ids but {len(msg.top_logprobs)} values")
    return Logprobs(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


def plan_to_proto(plan: StepPlan) -> scheduler_pb2.StepPlan:
    return scheduler_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            scheduler_pb2.NewRequest(
                request_id=r.request_id,
                token_ids=r.token_ids,
                sampling=sampling_to_proto(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                num_prompt_tokens=len(r.token_ids) if r.num_prompt_tokens is None else r.num_prompt_tokens,
            )
            for r in plan.new_requests
        ],
        running=[
            scheduler_pb2.RunningRequest(
                request_id=r.request_id,
                new_block_ids=r.new_block_ids,
                num_scheduled_tokens=r.num_scheduled_tokens,
                input_is_placeholder=r.input_is_placeholder,
                num_draft_tokens=r.num_draft_tokens,
            )
            for r in plan.running
        ],
        finished_ids=plan.finished_ids,
        preempted_ids=plan.preempted_ids,
        swap_out=[scheduler_pb2.BlockPair(src=s, dst=d) for s, d in plan.swap_out],
        swap_in=[scheduler_pb2.BlockPair(src=s, dst=d) for s, d in plan.swap_in],
    )


def plan_from_proto(msg: scheduler_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=tuple(
            NewRequest(
                request_id=r.request_id,
                token_ids=tuple(r.token_ids),
                sampling=sampling_from_proto(r.sampling, default_max_tokens=r.sampling.max_tokens),
                block_ids=tuple(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
            )
            for r in msg.new_requests
        ),
        running=tuple(
            RunningRequest(
                request_id=r.request_id,
                new_block_ids=tuple(r.new_block_ids),
                num_scheduled_tokens=r.num_scheduled_tokens,
                input_is_placeholder=r.input_is_placeholder,
                num_draft_tokens=r.num_draft_tokens,
            )
            for r in msg.running
        ),
        finished_ids=tuple(msg.finished_ids),
        preempted_ids=tuple(msg.preempted_ids),
        swap_out=tuple((p.src, p.dst) for p in msg.swap_out),
        swap_in=tuple((p.src, p.dst) for p in msg.swap_in),
    )


def timing_to_proto(t: WorkerTiming) -> scheduler_pb2.WorkerTiming:
    return scheduler_pb2.WorkerTiming(**dataclasses.asdict(t))


def timing_from_proto(msg: scheduler_pb2.WorkerTiming) -> WorkerTiming:
    return WorkerTiming(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(WorkerTiming)})


def result_to_proto(result: StepResult) -> scheduler_pb2.StepResult:
    return scheduler_pb2.StepResult(
        step_id=result.step_id, sampled_token_ids=result.sampled_token_ids, timing=timing_to_proto(result.timing),
        failed=result.failed, invalid_ids=result.invalid_ids, logprobs={k: logprobs_to_proto(v) for k, v in result.logprobs.items()},
        prompt_logprobs={k: scheduler_pb2.PromptLogprobs(start=v.start, entries=map(logprobs_to_proto, v.entries))
                         for k, v in result.prompt_logprobs.items()},
        speculation={rid: scheduler_pb2.SpecOutcome(num_draft_tokens=o.num_draft_tokens,
                                                    accepted_token_ids=o.accepted_token_ids,
                                                    accepted_logprobs=map(logprobs_to_proto, o.accepted_logprobs))
                     for rid, o in result.speculation.items()},
    )


def result_from_proto(msg: scheduler_pb2.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id, sampled_token_ids=dict(msg.sampled_token_ids), timing=timing_from_proto(msg.timing),
        failed=dict(msg.failed), invalid_ids=tuple(msg.invalid_ids), logprobs={k: logprobs_from_proto(v) for k, v in msg.logprobs.items()},
        prompt_logprobs={k: PromptLogprobs(v.start, tuple(map(logprobs_from_proto, v.entries)))
                         for k, v in msg.prompt_logprobs.items()},
        speculation={rid: SpecOutcome(o.num_draft_tokens, tuple(o.accepted_token_ids),
                                      tuple(map(logprobs_from_proto, o.accepted_logprobs)))
                     for rid, o in msg.speculation.items()},
    )


def step_record_to_proto(r: StepRecord) -> scheduler_pb2.StepRecord:
    fields = {k: v for k, v in vars(r).items() if k != "worker"}
    return scheduler_pb2.StepRecord(**fields, worker=timing_to_proto(r.worker))


def step_record_from_proto(msg: scheduler_pb2.StepRecord) -> StepRecord:
    names = [f.name for f in dataclasses.fields(StepRecord) if f.name != "worker"]
    return StepRecord(**{n: getattr(msg, n) for n in names}, worker=timing_from_proto(msg.worker))


def worker_info_to_proto(info: WorkerInfo) -> scheduler_pb2.WorkerHello:
    return scheduler_pb2.WorkerHello(
        worker_id=info.worker_id,
        model_name=info.model_name,
        model_type=info.model_type,
        dtype=info.dtype,
        device=info.device,
        block_size=info.block_size,
        num_device_blocks=info.num_device_blocks,
        num_host_blocks=info.num_host_blocks,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        max_logprobs=info.max_logprobs,
        group_id=info.group_id,
        tensor_parallel_rank=info.tp_rank,
        tensor_parallel_size=info.tp_size,
    )


def worker_info_from_proto(msg: scheduler_pb2.WorkerHello) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id,
        model_name=msg.model_name,
        model_type=msg.model_type,
        dtype=msg.dtype,
        device=msg.device,
        block_size=msg.block_size,
        num_device_blocks=msg.num_device_blocks,
        num_host_blocks=msg.num_host_blocks,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        max_logprobs=msg.max_logprobs or MAX_LOGPROBS,
        group_id=msg.group_id,
        tp_rank=msg.tensor_parallel_rank,
        tp_size=max(msg.tensor_parallel_size, 1),
    )
