from stepahead.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_CODE_INVALID: _ClassVar[RejectCode]
    REJECT_CODE_UNAVAILABLE: _ClassVar[RejectCode]
    REJECT_CODE_QUEUE_FULL: _ClassVar[RejectCode]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
REJECT_CODE_INVALID: RejectCode
REJECT_CODE_UNAVAILABLE: RejectCode
REJECT_CODE_QUEUE_FULL: RejectCode
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class JoinGroupRequest(_message.Message):
    __slots__ = ("worker_id", "tensor_parallel_size", "rendezvous_host", "rendezvous_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tensor_parallel_size: int
    rendezvous_host: str
    rendezvous_port: int
    def __init__(self, worker_id: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., rendezvous_host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ...) -> None: ...

class GroupAssignment(_message.Message):
    __slots__ = ("group_id", "rank", "world_size", "master_addr", "master_port")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    def __init__(self, group_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("submit", "abort", "options")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    abort: AbortRequest
    options: SessionOptions
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., options: _Optional[_Union[SessionOptions, _Mapping]] = ...) -> None: ...

class SessionOptions(_message.Message):
    __slots__ = ("plain_token_steps",)
    PLAIN_TOKEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    plain_token_steps: int
    def __init__(self, plain_token_steps: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events", "token_request_ids", "token_ids")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    token_request_ids: bytes
    token_ids: bytes
    def __init__(self, events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., token_request_ids: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "rejected", "message", "reject_code", "logprobs", "prompt_logprobs", "prompt_logprobs_start", "num_draft_tokens", "num_accepted_tokens", "num_spec_steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REJECT_CODE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    rejected: bool
    message: str
    reject_code: RejectCode
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    prompt_logprobs_start: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_spec_steps: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., rejected: _Optional[bool] = ..., message: _Optional[str] = ..., reject_code: _Optional[_Union[RejectCode, str]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., prompt_logprobs_start: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_spec_steps: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_total_blocks", "num_free_blocks", "kv_usage", "prefix_query_tokens", "prefix_hit_tokens", "num_preemptions", "num_steps", "num_finished", "num_in_flight", "num_fenced_blocks", "num_used_host_blocks", "num_aborted", "device_busy_s", "num_sampled_tokens", "worker_attached", "spec_num_draft_tokens", "spec_num_accepted_tokens", "num_slid_blocks", "prefix_host_hit_tokens", "num_offloaded_blocks", "num_host_evictions", "num_handoffs", "num_loaded_blocks", "num_failed_loads", "num_loading", "replicas")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLID_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_total_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_finished: int
    num_in_flight: int
    num_fenced_blocks: int
    num_used_host_blocks: int
    num_aborted: int
    device_busy_s: float
    num_sampled_tokens: int
    worker_attached: bool
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    num_slid_blocks: int
    prefix_host_hit_tokens: int
    num_offloaded_blocks: int
    num_host_evictions: int
    num_handoffs: int
    num_loaded_blocks: int
    num_failed_loads: int
    num_loading: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., num_fenced_blocks: _Optional[int] = ..., num_used_host_blocks: _Optional[int] = ..., num_aborted: _Optional[int] = ..., device_busy_s: _Optional[float] = ..., num_sampled_tokens: _Optional[int] = ..., worker_attached: _Optional[bool] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., num_slid_blocks: _Optional[int] = ..., prefix_host_hit_tokens: _Optional[int] = ..., num_offloaded_blocks: _Optional[int] = ..., num_host_evictions: _Optional[int] = ..., num_handoffs: _Optional[int] = ..., num_loaded_blocks: _Optional[int] = ..., num_failed_loads: _Optional[int] = ..., num_loading: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: SchedulerStats
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[SchedulerStats, _Mapping]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "model_name", "model_type", "dtype", "device", "block_size", "num_device_blocks", "num_host_blocks", "max_model_len", "vocab_size", "eos_token_ids", "max_logprobs", "group_id", "tensor_parallel_rank", "tensor_parallel_size", "no_logprobs", "no_structured_outputs", "sliding_window", "num_offload_blocks", "role", "kv_transfer_address", "kv_transfer_instance", "prepares_grammars")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NO_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NO_STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREPARES_GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_name: str
    model_type: str
    dtype: str
    device: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_logprobs: int
    group_id: str
    tensor_parallel_rank: int
    tensor_parallel_size: int
    no_logprobs: bool
    no_structured_outputs: bool
    sliding_window: int
    num_offload_blocks: int
    role: WorkerRole
    kv_transfer_address: str
    kv_transfer_instance: str
    prepares_grammars: bool
    def __init__(self, worker_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_type: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_logprobs: _Optional[int] = ..., group_id: _Optional[str] = ..., tensor_parallel_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., no_logprobs: _Optional[bool] = ..., no_structured_outputs: _Optional[bool] = ..., sliding_window: _Optional[int] = ..., num_offload_blocks: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., kv_transfer_address: _Optional[str] = ..., kv_transfer_instance: _Optional[str] = ..., prepares_grammars: _Optional[bool] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "result", "fatal_error", "detach", "kv_loaded", "grammar_ready")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FATAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_READY_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    result: StepResult
    fatal_error: str
    detach: str
    kv_loaded: KVLoaded
    grammar_ready: GrammarReady
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., fatal_error: _Optional[str] = ..., detach: _Optional[str] = ..., kv_loaded: _Optional[_Union[KVLoaded, _Mapping]] = ..., grammar_ready: _Optional[_Union[GrammarReady, _Mapping]] = ...) -> None: ...

class GrammarReady(_message.Message):
    __slots__ = ("request_id", "error", "invalid")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: str
    invalid: bool
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[str] = ..., invalid: _Optional[bool] = ...) -> None: ...

class GrammarPrep(_message.Message):
    __slots__ = ("request_id", "structured")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    structured: _common_pb2.StructuredOutputs
    def __init__(self, request_id: _Optional[str] = ..., structured: _Optional[_Union[_common_pb2.StructuredOutputs, _Mapping]] = ...) -> None: ...

class KVLoaded(_message.Message):
    __slots__ = ("transfer_id", "error")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    error: str
    def __init__(self, transfer_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class KVLoad(_message.Message):
    __slots__ = ("transfer_id", "source", "src_block_ids", "dst_block_ids", "source_instance")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    source: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    source_instance: str
    def __init__(self, transfer_id: _Optional[int] = ..., source: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., source_instance: _Optional[str] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class RunningDeltas(_message.Message):
    __slots__ = ("request_ids", "num_scheduled_tokens", "input_is_placeholder", "num_draft_tokens", "num_new_blocks", "new_block_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IS_PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: bytes
    num_scheduled_tokens: bytes
    input_is_placeholder: bytes
    num_draft_tokens: bytes
    num_new_blocks: bytes
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[bytes] = ..., num_scheduled_tokens: _Optional[bytes] = ..., input_is_placeholder: _Optional[bytes] = ..., num_draft_tokens: _Optional[bytes] = ..., num_new_blocks: _Optional[bytes] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "running", "finished_ids", "preempted_ids", "swap_out", "swap_in", "kv_loads", "grammars")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    KV_LOADS_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running: RunningDeltas
    finished_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_ids: _containers.RepeatedScalarFieldContainer[str]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    kv_loads: _containers.RepeatedCompositeFieldContainer[KVLoad]
    grammars: _containers.RepeatedCompositeFieldContainer[GrammarPrep]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running: _Optional[_Union[RunningDeltas, _Mapping]] = ..., finished_ids: _Optional[_Iterable[str]] = ..., preempted_ids: _Optional[_Iterable[str]] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., kv_loads: _Optional[_Iterable[_Union[KVLoad, _Mapping]]] = ..., grammars: _Optional[_Iterable[_Union[GrammarPrep, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_request_ids", "sampled_token_ids", "timing", "failed", "logprobs", "prompt_logprobs", "speculation", "invalid_ids")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Logprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PromptLogprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...
    class SpeculationEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SpecOutcome
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SpecOutcome, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    INVALID_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_request_ids: bytes
    sampled_token_ids: bytes
    timing: WorkerTiming
    failed: _containers.ScalarMap[str, str]
    logprobs: _containers.MessageMap[str, _common_pb2.Logprobs]
    prompt_logprobs: _containers.MessageMap[str, PromptLogprobs]
    speculation: _containers.MessageMap[str, SpecOutcome]
    invalid_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., sampled_request_ids: _Optional[bytes] = ..., sampled_token_ids: _Optional[bytes] = ..., timing: _Optional[_Union[WorkerTiming, _Mapping]] = ..., failed: _Optional[_Mapping[str, str]] = ..., logprobs: _Optional[_Mapping[str, _common_pb2.Logprobs]] = ..., prompt_logprobs: _Optional[_Mapping[str, PromptLogprobs]] = ..., speculation: _Optional[_Mapping[str, SpecOutcome]] = ..., invalid_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("start", "entries")
    START_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    start: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, start: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class SpecOutcome(_message.Message):
    __slots__ = ("num_draft_tokens", "accepted_token_ids", "accepted_logprobs")
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_draft_tokens: int
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, num_draft_tokens: _Optional[int] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., accepted_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class WorkerTiming(_message.Message):
    __slots__ = ("plan_received", "prep_start", "forward_start", "forward_end", "result_sent", "device_busy_s")
    PLAN_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PREP_START_FIELD_NUMBER: _ClassVar[int]
    FORWARD_START_FIELD_NUMBER: _ClassVar[int]
    FORWARD_END_FIELD_NUMBER: _ClassVar[int]
    RESULT_SENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    plan_received: float
    prep_start: float
    forward_start: float
    forward_end: float
    result_sent: float
    device_busy_s: float
    def __init__(self, plan_received: _Optional[float] = ..., prep_start: _Optional[float] = ..., forward_start: _Optional[float] = ..., forward_end: _Optional[float] = ..., result_sent: _Optional[float] = ..., device_busy_s: _Optional[float] = ...) -> None: ...

class GetFlightRecordRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlightRecord(_message.Message):
    __slots__ = ("worker_id", "steps")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    def __init__(self, worker_id: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("step_id", "schedule_start", "schedule_end", "plan_sent", "commit_start", "result_committed", "num_requests", "num_tokens", "num_running", "num_waiting", "worker", "replica")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_START_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_END_FIELD_NUMBER: _ClassVar[int]
    PLAN_SENT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_START_FIELD_NUMBER: _ClassVar[int]
    RESULT_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    schedule_start: float
    schedule_end: float
    plan_sent: float
    commit_start: float
    result_committed: float
    num_requests: int
    num_tokens: int
    num_running: int
    num_waiting: int
    worker: WorkerTiming
    replica: str
    def __init__(self, step_id: _Optional[int] = ..., schedule_start: _Optional[float] = ..., schedule_end: _Optional[float] = ..., plan_sent: _Optional[float] = ..., commit_start: _Optional[float] = ..., result_committed: _Optional[float] = ..., num_requests: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., worker: _Optional[_Union[WorkerTiming, _Mapping]] = ..., replica: _Optional[str] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "instance")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    instance: str
    def __init__(self, transfer_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., instance: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("num_blocks", "bytes_per_block", "data")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_per_block: int
    data: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
