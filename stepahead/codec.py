"""Domain objects (stepahead.plan) ⇄ protobuf messages (stepahead.v1).

Servicers stay thin: they call these converters and hand domain objects to domain code.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate, chain, compress

from stepahead.columns import SampledTokens, pack_flags, pack_ids, pack_u32, unpack_flags, unpack_ids, unpack_u32
from stepahead.flight_recorder import StepRecord
from stepahead.logprobs import MAX_LOGPROBS, Logprobs, PromptLogprobs
from stepahead.plan import (
    FinishReason,
    GrammarPrep,
    GrammarReady,
    KVLoad,
    KVLoaded,
    NewRequest,
    RunningDeltas,
    SamplingParams,
    SpecOutcome,
    StepPlan,
    StepResult,
    StructuredKind,
    StructuredOutput,
    WorkerInfo,
    WorkerRole,
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
    gate = {"start_after_token_ids": s.start_after} if s.start_after else {}
    if s.kind is StructuredKind.JSON_OBJECT:
        return common_pb2.StructuredOutputs(json_object=True, **gate)
    if s.kind is StructuredKind.CHOICE:
        return common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=s.choices), **gate)
    return common_pb2.StructuredOutputs(**{_STRUCTURED_TEXT_FIELDS[s.kind]: s.spec}, **gate)


def structured_from_proto(so: common_pb2.StructuredOutputs) -> StructuredOutput | None:
    """None when `so` holds no constraint (`json_object: false` included)."""
    which = so.WhichOneof("constraint")
    if which is None or (which == "json_object" and not so.json_object):
        return None
    gate = tuple(so.start_after_token_ids)
    if which == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT, start_after=gate)
    if which == "choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(so.choice.choices), start_after=gate)
    return StructuredOutput(_STRUCTURED_FROM_FIELD[which], spec=getattr(so, which), start_after=gate)


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
        structured=structured_from_proto(msg.structured_outputs) if msg.HasField("structured_outputs") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def submit_to_proto(request_id: str, prompt_token_ids, sampling: SamplingParams,
                    priority: int) -> scheduler_pb2.SubmitRequest:
    """A gateway's submission of one upstream sequence (the scheduler reads it back with
    `sampling_from_proto`)."""
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                       sampling=sampling_to_proto(sampling), priority=priority)


def logprobs_to_proto(lp: Logprobs) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                               top_logprobs=[v for _, v in lp.top])


def logprobs_from_proto(msg: common_pb2.Logprobs) -> Logprobs:
    if len(msg.top_token_ids) != len(msg.top_logprobs):
        raise ValueError(f"logprobs: {len(msg.top_token_ids)} top_token_ids but {len(msg.top_logprobs)} values")
    return Logprobs(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


def plan_to_proto(plan: StepPlan, out: scheduler_pb2.StepPlan | None = None) -> scheduler_pb2.StepPlan:
    """The plan as a message; filled into `out` when given (e.g. a `SchedulerMessage`'s
    `plan`: building a message around a finished one copies it)."""
    msg = scheduler_pb2.StepPlan() if out is None else out
    msg.SetInParent()
    msg.step_id = plan.step_id
    if plan.new_requests:
        msg.new_requests.extend(
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
        )
    msg.finished_ids.extend(plan.finished_ids)
    msg.preempted_ids.extend(plan.preempted_ids)
    if plan.swap_out or plan.swap_in:
        msg.swap_out.extend(scheduler_pb2.BlockPair(src=s, dst=d) for s, d in plan.swap_out)
        msg.swap_in.extend(scheduler_pb2.BlockPair(src=s, dst=d) for s, d in plan.swap_in)
    if plan.running:
        _running_to_proto(plan.running, msg.running)
    if plan.kv_loads:
        msg.kv_loads.extend(scheduler_pb2.KVLoad(transfer_id=x.transfer_id, source=x.source,
                                                 src_block_ids=x.src_block_ids, dst_block_ids=x.dst_block_ids,
                                                 source_instance=x.source_instance)
                            for x in plan.kv_loads)
    if plan.grammars:
        msg.grammars.extend(scheduler_pb2.GrammarPrep(request_id=g.request_id, structured=structured_to_proto(g.structured))
                            for g in plan.grammars)
    return msg


def _running_to_proto(running: RunningDeltas, out: scheduler_pb2.RunningDeltas) -> None:
    """The deltas' columns, packed (`stepahead.columns`)."""
    out.request_ids = pack_ids(running.request_ids)
    out.num_scheduled_tokens = pack_u32(running.num_scheduled_tokens)
    out.input_is_placeholder = pack_flags(running.input_is_placeholder)
    out.num_draft_tokens = pack_u32(running.num_draft_tokens)
    counts, blocks = running.num_new_blocks, running.new_block_ids
    out.num_new_blocks = pack_u32(counts)
    if any(counts):  # the few requests that got a block this step
        out.new_block_ids.extend(chain.from_iterable(compress(blocks, counts)))


def plan_from_proto(msg: scheduler_pb2.StepPlan) -> StepPlan:
    """Proto → domain; ValueError naming the field when the running columns do not line up."""
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
        running=_running_from_proto(msg.running),
        finished_ids=tuple(msg.finished_ids),
        preempted_ids=tuple(msg.preempted_ids),
        swap_out=tuple((p.src, p.dst) for p in msg.swap_out),
        swap_in=tuple((p.src, p.dst) for p in msg.swap_in),
        kv_loads=tuple(_kv_load_from_proto(x) for x in msg.kv_loads),
        grammars=tuple(_grammar_prep_from_proto(g) for g in msg.grammars),
    )


def _grammar_prep_from_proto(msg: scheduler_pb2.GrammarPrep) -> GrammarPrep:
    """ValueError naming the field when the entry holds no constraint."""
    structured = structured_from_proto(msg.structured)
    if structured is None:
        raise ValueError(f"grammars: request {msg.request_id[:100]!r} has no constraint")
    return GrammarPrep(msg.request_id, structured)


def _kv_load_from_proto(msg: scheduler_pb2.KVLoad) -> KVLoad:
    """ValueError naming the field when the two block lists do not pair up."""
    if len(msg.src_block_ids) != len(msg.dst_block_ids):
        raise ValueError(f"kv_loads: transfer {msg.transfer_id} has {len(msg.src_block_ids)} src_block_ids "
                         f"but {len(msg.dst_block_ids)} dst_block_ids")
    return KVLoad(msg.transfer_id, msg.source, tuple(msg.src_block_ids), tuple(msg.dst_block_ids),
                  msg.source_instance)


def kv_loaded_to_proto(loaded: KVLoaded) -> scheduler_pb2.KVLoaded:
    return scheduler_pb2.KVLoaded(transfer_id=loaded.transfer_id, error=loaded.error)


def kv_loaded_from_proto(msg: scheduler_pb2.KVLoaded) -> KVLoaded:
    return KVLoaded(msg.transfer_id, msg.error)


def grammar_ready_to_proto(ready: GrammarReady) -> scheduler_pb2.GrammarReady:
    return scheduler_pb2.GrammarReady(request_id=ready.request_id, error=ready.error, invalid=ready.invalid)


def grammar_ready_from_proto(msg: scheduler_pb2.GrammarReady) -> GrammarReady:
    return GrammarReady(msg.request_id, msg.error, msg.invalid)


_ROLE_TO_PROTO = {
    WorkerRole.BOTH: scheduler_pb2.WORKER_ROLE_BOTH,
    WorkerRole.PREFILL: scheduler_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: scheduler_pb2.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


def _role_from_proto(value: int) -> WorkerRole:
    if value not in _ROLE_FROM_PROTO:
        raise ValueError(f"role: unknown value {value}")
    return _ROLE_FROM_PROTO[value]


def _running_from_proto(d: scheduler_pb2.RunningDeltas) -> RunningDeltas:
    field = "StepPlan.running."
    ids = unpack_ids(d.request_ids, field + "request_ids")
    n = len(ids)
    scheduled = unpack_u32(d.num_scheduled_tokens, field + "num_scheduled_tokens")
    placeholder = unpack_flags(d.input_is_placeholder, field + "input_is_placeholder")
    drafts = unpack_u32(d.num_draft_tokens, field + "num_draft_tokens")
    num_blocks = unpack_u32(d.num_new_blocks, field + "num_new_blocks")
    for name, column in (("num_scheduled_tokens", scheduled), ("input_is_placeholder", placeholder),
                         ("num_draft_tokens", drafts), ("num_new_blocks", num_blocks)):
        if len(column) != n:
            raise ValueError(f"{field}{name}: {len(column)} entries for {n} request_ids")
    blocks = _split_blocks(d.new_block_ids, num_blocks) if d.new_block_ids else ((),) * n
    if not d.new_block_ids and any(num_blocks):
        raise ValueError(f"{field}new_block_ids: no blocks but num_new_blocks adds up to {sum(num_blocks)}")
    return RunningDeltas(ids, blocks, scheduled, placeholder, drafts)


def _split_blocks(flat, counts) -> list[tuple[int, ...]]:
    """Each request's run of the concatenated `new_block_ids` (ValueError when they do not add
    up). Only requests with new blocks cost a Python step (a decode gets one every block_size steps)."""
    flat, ends = tuple(flat), list(accumulate(counts))
    if (ends[-1] if ends else 0) != len(flat):
        raise ValueError(f"StepPlan.running.new_block_ids: {len(flat)} blocks but num_new_blocks adds up to "
                         f"{ends[-1] if ends else 0}")
    out: list[tuple[int, ...]] = [()] * len(ends)
    for i in compress(range(len(ends)), counts):
        out[i] = flat[ends[i] - counts[i]:ends[i]]
    return out


def timing_to_proto(t: WorkerTiming) -> scheduler_pb2.WorkerTiming:
    return scheduler_pb2.WorkerTiming(plan_received=t.plan_received, prep_start=t.prep_start,
                                      forward_start=t.forward_start, forward_end=t.forward_end,
                                      result_sent=t.result_sent, device_busy_s=t.device_busy_s)


def timing_from_proto(msg: scheduler_pb2.WorkerTiming) -> WorkerTiming:
    return WorkerTiming(msg.plan_received, msg.prep_start, msg.forward_start, msg.forward_end, msg.result_sent,
                        msg.device_busy_s)


def result_to_proto(result: StepResult) -> scheduler_pb2.StepResult:
    sampled = result.sampled_token_ids
    msg = scheduler_pb2.StepResult(step_id=result.step_id, sampled_request_ids=pack_ids(list(sampled)),
                                   sampled_token_ids=pack_u32(list(sampled.values())),
                                   timing=timing_to_proto(result.timing), failed=result.failed,
                                   invalid_ids=result.invalid_ids)
    if result.logprobs or result.prompt_logprobs or result.speculation:
        _extras_to_proto(result, msg)
    return msg


def _extras_to_proto(result: StepResult, msg: scheduler_pb2.StepResult) -> None:
    for k, v in result.logprobs.items():
        msg.logprobs[k].CopyFrom(logprobs_to_proto(v))
    for k, v in result.prompt_logprobs.items():
        msg.prompt_logprobs[k].CopyFrom(
            scheduler_pb2.PromptLogprobs(start=v.start, entries=map(logprobs_to_proto, v.entries)))
    for rid, o in result.speculation.items():
        msg.speculation[rid].CopyFrom(scheduler_pb2.SpecOutcome(
            num_draft_tokens=o.num_draft_tokens, accepted_token_ids=o.accepted_token_ids,
            accepted_logprobs=map(logprobs_to_proto, o.accepted_logprobs)))


def result_from_proto(msg: scheduler_pb2.StepResult) -> StepResult:
    """Proto → domain; ValueError naming the field when the sampled columns are malformed (a
    malformed or repeated id: when the sampled ids are first read, `SampledTokens`)."""
    tokens = unpack_u32(msg.sampled_token_ids, "StepResult.sampled_token_ids")
    sampled = SampledTokens(msg.sampled_request_ids, tokens, "StepResult.sampled_token_ids")  # ids parsed on use
    extras = {}
    if msg.logprobs or msg.prompt_logprobs or msg.speculation:
        extras = dict(
            logprobs={k: logprobs_from_proto(v) for k, v in msg.logprobs.items()},
            prompt_logprobs={k: PromptLogprobs(v.start, tuple(map(logprobs_from_proto, v.entries)))
                             for k, v in msg.prompt_logprobs.items()},
            speculation={rid: SpecOutcome(o.num_draft_tokens, tuple(o.accepted_token_ids),
                                          tuple(map(logprobs_from_proto, o.accepted_logprobs)))
                         for rid, o in msg.speculation.items()})
    return StepResult(
        step_id=msg.step_id, sampled_token_ids=sampled, timing=timing_from_proto(msg.timing),
        failed=dict(msg.failed) if msg.failed else {}, invalid_ids=tuple(msg.invalid_ids), **extras,
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
        no_logprobs=not info.logprobs,
        no_structured_outputs=not info.structured_outputs,
        prepares_grammars=info.prepares_grammars,
        sliding_window=info.sliding_window,
        num_offload_blocks=info.num_offload_blocks,
        role=_ROLE_TO_PROTO[info.role],
        kv_transfer_address=info.kv_transfer_address,
        kv_transfer_instance=info.kv_transfer_instance,
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
        logprobs=not msg.no_logprobs,
        structured_outputs=not msg.no_structured_outputs,
        prepares_grammars=msg.prepares_grammars,
        sliding_window=msg.sliding_window,
        num_offload_blocks=msg.num_offload_blocks,
        role=_role_from_proto(msg.role),
        kv_transfer_address=msg.kv_transfer_address,
        kv_transfer_instance=msg.kv_transfer_instance,
    )
