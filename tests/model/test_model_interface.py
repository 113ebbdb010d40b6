"""Every registered model family's declarations (`worker_service/models/interface.py`) are
complete and agree with its modules and with Hugging Face: each parameter of the built model
is declared with its shape, each HF tensor fills exactly one declared slot (or is ignored),
every tensor-parallel split reassembles the full tensor and matches the sharded modules, and
the sim cost model's counts equal the built model's. A new family that forgets a piece fails
here. Models are built on the meta device: no weights, no checkpoint files but config.json."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

from testing.checkpoints import VARIANTS, hf_config
from worker_service.layers.moe import MoEExperts
from worker_service.loader import check_declaration, copy_into, tie_weights
from worker_service.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from worker_service.models import FAMILIES
from worker_service.models.interface import TP, Kind, Source
from worker_service.models.llama_spec import QWEN3, LlamaFamily
from worker_service.parallel.geometry import GeometryError, ShardGeometry
from worker_service.parallel.layers import (GatheredLMHead, RowParallelExperts, RowParallelLinear, ShardedRMSNorm,
                                            VocabParallelEmbedding, shard_modules)
from worker_service.sim.cost import ModelGeometry

# The test checkpoints, plus the ones that exercise a family's optional parameters.
CASES = {**VARIANTS,
         "llama_attention_bias": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True)),
         "qwen2_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
         "olmo2_attention_bias_tied": ("olmo2", dict(num_attention_heads=4, num_key_value_heads=4,
                                                     attention_bias=True, tie_word_embeddings=True)),
         # every other layer sparse, one of those dense again; top-1 of 3 experts, tied
         "qwen3_moe_sparse_step": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=4,
                                                     tie_word_embeddings=True, num_experts=3, num_experts_per_tok=1,
                                                     moe_intermediate_size=16, num_hidden_layers=5,
                                                     decoder_sparse_step=2, mlp_only_layers=[3])),
         # n_inner unset (4 * n_embd), untied head, another GELU
         "gpt2_untied_gelu_tanh": ("gpt2", dict(num_attention_heads=8, tie_word_embeddings=False,
                                                activation_function="gelu_pytorch_tanh")),
         # q/k/v/o biases, untied head; Gemma 3 tied, its default sliding_window_pattern (6)
         "gemma2_attention_bias_untied": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         attention_bias=True, tie_word_embeddings=False)),
         "gemma3_text_tied_pattern6": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=1,
                                                           head_dim=16, num_hidden_layers=7))}


def test_every_registered_family_has_a_test_case():
    assert {model_type for model_type, _ in CASES.values()} == set(FAMILIES)


def _case(name, tmp_path):
    model_type, overrides = CASES[name]
    hf_cfg = hf_config(model_type, **overrides)
    hf_cfg.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    return hf_cfg, cfg, FAMILIES[cfg.model_type]


def _meta(cls, cfg) -> nn.Module:
    with torch.device("meta"):
        return cls(cfg)


def _hf_tensors(hf_cfg) -> tuple[dict[str, tuple[int, ...]], int]:
    """The tensor names and shapes `save_pretrained` writes (bar a tied head) and the HF model's
    parameter count. A model whose checkpoint names differ from its parameters' (transformers 5
    stacks MoE experts in memory, saves one tensor per expert) is saved to find them."""
    import tempfile

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if not any("experts" in n for n in names):
        return names, model.num_parameters()
    model = AutoModelForCausalLM.from_config(hf_cfg)
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        with safe_open(f"{out}/model.safetensors", framework="pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}, model.num_parameters()


def _slot(p, s) -> tuple[int, ...]:
    """The shape of source `s`'s slot in parameter `p` (one index of a stacked one: without pack_dim)."""
    slot = list(p.shape)
    if s.stack:
        del slot[p.pack_dim]
    else:
        slot[p.pack_dim] = s.size
    return tuple(slot)


@pytest.mark.parametrize("name", sorted(CASES))
def test_declaration_matches_the_modules_and_the_checkpoint(name, tmp_path):
    hf_cfg, cfg, fam = _case(name, tmp_path)
    model = _meta(fam.model_class(), cfg)
    declared = check_declaration(fam, model)  # names and shapes equal the built model's
    assert len({p.name for p in declared}) == len(declared)

    hf, hf_num_params = _hf_tensors(hf_cfg)
    tensors = [s for p in declared for _, s in p.tensors()]  # a fused tensor's parts merged
    assert len({s.name for s in tensors}) == len(tensors), "a checkpoint tensor fills two slots"
    assert {s.name for s in tensors} == {n for n in hf if not fam.ignores(n, cfg)}
    for p in declared:
        assert sum(s.size for s in p.sources) == p.shape[p.pack_dim], p.name
        for _, s in p.tensors():  # each checkpoint tensor's slot has the HF tensor's shape
            assert _slot(p, s) == (hf[s.name][::-1] if s.transpose else hf[s.name]), s.name  # Conv1D: [in, out]

    counts = fam.counts(cfg)
    built = {id(p): p.numel() for p in model.parameters()}  # a tied weight once
    assert counts.num_parameters == sum(built.values()) == hf_num_params == cfg.num_parameters()
    head = model.get_submodule(fam.lm_head)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    assert counts.linear_params == linear
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert counts.expert_params == sum(p.numel() for m in experts for p in m.parameters())
    assert (counts.num_experts, counts.experts_per_token) == (cfg.num_experts, cfg.num_experts_per_tok)
    assert counts.num_parameters == counts.linear_params + counts.expert_params + sum(
        p.numel for p in declared if p.kind in (Kind.OTHER, Kind.LM_HEAD, Kind.EMBEDDING))
    assert counts.lm_head_params == head.weight.numel()
    assert counts.lookup_params == (0 if fam.tied(cfg) else model.get_submodule(fam.embedding).weight.numel())
    geometry = ModelGeometry.from_config(cfg, "bfloat16")
    assert geometry.num_parameters == counts.num_parameters
    assert geometry.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("k", [2, 4])
def test_every_split_reassembles_the_tensor_and_matches_the_sharded_modules(name, k, tmp_path):
    hf_cfg, cfg, fam = _case(name, tmp_path)
    hf, _ = _hf_tensors(hf_cfg)
    geoms = [ShardGeometry.of(cfg, r, k) for r in range(k)]  # every case is built to split 2 and 4 ways
    declared = fam.params(cfg)
    axes = {a.name for a in fam.axes}
    for p in declared:
        split = {s.axis for s in p.sources}
        assert (p.tp is TP.REPLICATED) == (split == {None}), p.name
        assert split <= axes | {None}, p.name
        if p.tp is TP.ROW:
            assert all(s.param_dim() == 1 for s in p.sources), p.name
        if p.tp in (TP.COLUMN, TP.COLUMN_NORM, TP.VOCAB):
            assert all(s.param_dim() == p.pack_dim for s in p.sources), p.name
        if p.tp is TP.EXPERT:  # one expert's tensor per source, split along its intermediate dim
            assert all(s.stack and s.axis for s in p.sources), p.name
        assert all(len(p.shape) == 2 for s in p.sources if s.transpose), p.name
    for p in declared:
        for _, s in p.tensors():
            parts = [part for part in p.sources if part.name == s.name]  # several: a fused tensor
            split = any(part.axis is not None for part in parts)
            covered: set[int] = set()
            lengths = set()
            for g in geoms:
                cuts = g.slice_of(s.name)
                if cuts is None:
                    assert not split
                    continue
                assert len(cuts) == len(parts) and {dim for dim, _, _ in cuts} == {s.dim}
                for dim, start, length in cuts:
                    covered.update(range(start, start + length))
                lengths.add(sum(length for _, _, length in cuts))
            if split:
                assert covered == set(range(hf[s.name][s.dim])), f"{s.name}: the ranks' slices miss part of it"
                assert len(lengths) == 1

    for g in geoms:  # the shard's modules are what its declaration says, slice by slice
        local = g.local_config(cfg)
        with torch.device("meta"):
            model = fam.model_class()(local)
            shard_modules(model, g)
        tie_weights(model, fam)  # as load_shard does
        local_declared = check_declaration(fam, model)
        row_modules = {p.module for p in local_declared if p.tp is TP.ROW}  # their biases are replicated
        for p in local_declared:
            for _, s in p.tensors():  # the slice read from the checkpoint fits the shard's slot
                cuts = g.slice_of(s.name)
                if cuts is not None:
                    dim = 1 - cuts[0][0] if s.transpose else cuts[0][0]  # the parameter's dim
                    length = sum(length for _, _, length in cuts)
                    assert length == (s.size if dim == p.pack_dim and not s.stack else _slot(p, s)[dim]), s.name
            module = model.get_submodule(p.module)
            if p.tp is TP.ROW:
                assert isinstance(module, RowParallelLinear), p.module
            elif p.tp is TP.VOCAB:
                assert isinstance(module, VocabParallelEmbedding if p.kind is Kind.EMBEDDING else GatheredLMHead)
            elif p.tp is TP.COLUMN_NORM:
                assert isinstance(module, ShardedRMSNorm), p.module
            elif p.tp is TP.EXPERT:
                assert isinstance(module, RowParallelExperts), p.module
            else:
                assert isinstance(module, RowParallelLinear) == (p.module in row_modules), p.module
                assert not isinstance(module, (VocabParallelEmbedding, GatheredLMHead, ShardedRMSNorm)), p.module
        assert isinstance(model.get_submodule(fam.lm_head), GatheredLMHead)


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n][0] in ("qwen3_moe", "mixtral")))
@pytest.mark.parametrize("k", [2, 4])
def test_expert_parallel_places_every_expert_whole_on_exactly_one_rank(name, k, tmp_path):
    hf_cfg, cfg, fam = _case(name, tmp_path)
    hf, _ = _hf_tensors(hf_cfg)
    if cfg.num_experts % k:  # e.g. 3 experts: refused, naming config.json's field
        with pytest.raises(GeometryError, match=f"num_(local_)?experts \\({cfg.num_experts}\\)"):
            ShardGeometry.of(cfg, 0, k, expert_parallel=True)
        return
    geoms = [ShardGeometry.of(cfg, r, k, expert_parallel=True) for r in range(k)]
    expert_tensors = {s.name for p in fam.params(cfg) if p.tp is TP.EXPERT for s in p.sources}
    assert expert_tensors and all(g.elsewhere <= expert_tensors for g in geoms)
    for tensor in expert_tensors:
        holders = [g for g in geoms if tensor not in g.elsewhere]
        assert len(holders) == 1, f"{tensor}: held by ranks {[g.rank for g in holders]}"
        cuts = holders[0].slice_of(tensor)
        assert cuts is None or all(length == hf[tensor][dim] for dim, _, length in cuts), tensor  # whole
    shares = [(g.local_config(cfg).first_local_expert, g.local_config(cfg).num_local_experts) for g in geoms]
    assert shares == [(r * cfg.num_experts // k, cfg.num_experts // k) for r in range(k)]
    for g in geoms:  # the shard's modules are what its declaration says
        local = g.local_config(cfg)
        with torch.device("meta"):
            model = fam.model_class()(local)
            shard_modules(model, g)
        tie_weights(model, fam)  # as load_shard does
        for p in check_declaration(fam, model):
            if p.tp is TP.EXPERT:
                module = model.get_submodule(p.module)
                assert isinstance(module, RowParallelExperts), p.module
                assert (module.first, module.num_experts, module.total) == (
                    local.first_local_expert, local.num_local_experts, cfg.num_experts)
            if p.name.endswith("mlp.gate.weight"):
                assert p.shape[0] == cfg.num_experts  # the router scores all experts on every rank


def test_a_family_that_forgets_a_parameter_is_refused(tmp_path):
    _, cfg, fam = _case("qwen3_tied_gqa1", tmp_path)

    @dataclasses.dataclass(frozen=True)
    class Forgetful(LlamaFamily):
        def params(self, cfg):
            return [p for p in super().params(cfg) if not p.name.endswith("k_norm.weight")]

    model = _meta(fam.model_class(), cfg)
    with pytest.raises(RuntimeError, match="k_norm"):
        check_declaration(Forgetful(QWEN3.model_type, QWEN3.module, qk_norm=True), model)


def test_a_source_is_copied_along_any_dim_or_as_one_stacked_slice():
    dst = torch.zeros(2, 3, 4)  # [experts, out, in]
    copy_into(dst, 2, 1, Source("w", 2), "w", torch.ones(2, 3, 2))  # columns 1..2 of every expert
    assert dst[:, :, 1:3].eq(1).all() and dst[:, :, [0, 3]].eq(0).all()
    copy_into(dst, 0, 1, Source("e1", 1, stack=True), "e1", torch.full((3, 4), 7.0))  # expert 1: [out, in]
    assert dst[1].eq(7).all() and dst[0, :, 1:3].eq(1).all()
    with pytest.raises(ValueError, match="'e0' has shape \\(4, 3\\), expected \\(3, 4\\)"):
        copy_into(dst, 0, 0, Source("e0", 1, stack=True), "e0", torch.zeros(4, 3))
    w = torch.zeros(6, 2)  # [out, in]: rows 2..5 from a Conv1D part [in, out] = [2, 4]
    conv = torch.arange(8.0).view(2, 4)
    copy_into(w, 0, 2, Source("c", 4, transpose=True), "c", conv)
    assert w[2:].equal(conv.t()) and w[:2].eq(0).all()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_serve_accepts_every_registered_family_up_front(model_type, tmp_path):
    """`stepahead serve`'s check before any daemon starts (`cli/serve.check_checkpoint`) takes a
    checkpoint of each family as transformers saves its config."""
    from cli.serve import check_checkpoint

    name = next(n for n, (t, _) in sorted(CASES.items()) if t == model_type)
    _case(name, tmp_path)  # config.json
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = check_checkpoint(str(tmp_path), types.SimpleNamespace(device="cpu", dtype=None))
    assert cfg.model_type == model_type and model_type in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("edit, named", [
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}),
     "unsupported rope type 'yarn' for model_type 'phi3'"),  # Phi3Config takes only default and longrope
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "unsupported rope type 'dynamic' for model_type 'phi3'"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
     "rope_scaling.short_factor has 4 entries"),  # Phi-3-128k's config.json, with too few factors
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor must be a number in"),
])
def test_phi3_rope_it_does_not_implement_is_refused_naming_the_field(edit, named, tmp_path):
    import json

    from worker_service.model_config import CheckpointError

    hf_config("phi3").save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("edit, named", [
    (dict(scale_attn_weights=False), "unsupported scale_attn_weights False"),
    (dict(scale_attn_by_inverse_layer_idx=True), "unsupported scale_attn_by_inverse_layer_idx True"),
    (dict(reorder_and_upcast_attn=True), "unsupported reorder_and_upcast_attn True"),
    (dict(add_cross_attention=True), "unsupported add_cross_attention True"),
    (dict(activation_function="quick_gelu"), "unsupported activation_function 'quick_gelu'"),
    (dict(n_head=5), "n_head \\(5\\) must be >= 1 and divide n_embd \\(64\\)"),
    (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon must be > 0"),
])
def test_gpt2_settings_it_does_not_implement_are_refused_naming_the_field(edit, named, tmp_path):
    import json

    from worker_service.model_config import CheckpointError

    hf_config("gpt2", num_attention_heads=4).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dir(tmp_path)


def test_gpt2_reads_its_own_config_names(tmp_path):
    """n_embd / n_head / n_layer / n_positions / n_inner / layer_norm_epsilon into the common
    config; the Llama names transformers leaves in config.json (intermediate_size) are not read."""
    import json

    # (hf_config passes the common names; GPT2Config saves them as n_embd, n_head, n_layer, n_positions)
    hf_config("gpt2", hidden_size=48, num_attention_heads=6, num_hidden_layers=3, max_position_embeddings=256,
              n_inner=None, layer_norm_epsilon=1e-3,
              activation_function="gelu").save_pretrained(tmp_path)
    assert "n_embd" in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (48, 6, 6, 8, 3)
    assert (cfg.max_position_embeddings, cfg.intermediate_size, cfg.rms_norm_eps) == (256, 192, 1e-3)
    assert cfg.hidden_act == "gelu" and cfg.tie_word_embeddings and cfg.sliding_window is None
    assert not FAMILIES["gpt2"].rope


def test_the_shared_layers_implement_every_activation_a_family_accepts():
    from worker_service.layers.activation import ACTIVATIONS
    from worker_service.models import gemma_spec, gpt2_spec

    accepted = {"silu", *gpt2_spec.ACTIVATIONS, *gemma_spec.ACTIVATIONS}  # Llama's families: silu only
    assert accepted - set(ACTIVATIONS) == set()


@pytest.mark.parametrize("model_type, edit, named", [
    ("qwen3_moe", dict(num_local_experts=0), "num_experts must be >= 1, got 0"),
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok \\(5\\) must be in \\[1, num_experts \\(4\\)\\]"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1, got 0"),
    ("qwen3_moe", dict(moe_intermediate_size=None), "field moe_intermediate_size is missing"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "unsupported shared_expert_intermediate_size 64"),
    ("mixtral", dict(num_local_experts=None), "field num_local_experts is missing"),
    ("mixtral", dict(num_experts_per_tok=0), "num_experts_per_tok \\(0\\) must be in \\[1, num_local_experts"),
])
def test_moe_config_it_cannot_build_is_refused_naming_the_field(model_type, edit, named, tmp_path):
    import json

    from worker_service.model_config import CheckpointError

    hf_config(model_type, num_local_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["qwen3_moe_untied_gqa2", "mixtral_tied_gqa2"])
def test_the_loader_refuses_a_missing_or_misshapen_expert_tensor_naming_it(name, tmp_path):
    from safetensors.torch import load_file, save_file

    from testing.checkpoints import build_checkpoint
    from worker_service.loader import load_model

    model_type, overrides = VARIANTS[name]
    build_checkpoint(tmp_path, model_type, **overrides)
    weights = load_file(tmp_path / "model.safetensors")
    expert = next(n for n in sorted(weights) if ".experts.3." in n)
    tensor = weights.pop(expert)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"checkpoint lacks weights for: .*experts.*\\(tensors {expert}\\)"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    weights[expert] = tensor[:, :-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"checkpoint tensor '{expert}' has shape"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_tied_gqa4"])
def test_a_checkpoint_of_the_bare_decoder_loads_like_the_full_one(name, tmp_path):
    """The hub's GPT-2 stores `h.0.attn...` (GPT2Model's names, no `transformer.`); HF's loading
    adds the prefix (base_model_prefix), so does ours, on one device and on a TP rank."""
    from testing.checkpoints import build_checkpoint
    from worker_service.loader import load_model
    from worker_service.parallel.loader import load_shard

    model_type, overrides = VARIANTS[name]
    hf = build_checkpoint(tmp_path / "full", model_type, **overrides)
    getattr(hf, hf.base_model_prefix).save_pretrained(tmp_path / "bare")  # the decoder alone (tied head)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bare" / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith(hf.base_model_prefix + ".") for k in f.keys())  # really bare
    for load in (lambda d: load_model(d, torch.float32, torch.device("cpu"))[0],
                 lambda d: load_shard(d, torch.float32, torch.device("cpu"), 1, 2)[0]):
        full, bare = dict(load(tmp_path / "full").state_dict()), dict(load(tmp_path / "bare").state_dict())
        assert full.keys() == bare.keys()
        for key, tensor in full.items():
            assert torch.equal(tensor, bare[key]), key
