"""DeepSeek-V2 / V3 (latent attention, DeepSeek's experts) against transformers' eager models,
on tiny random checkpoints: chunked prefill across blocks of a shuffled table, decodes, mixed
batches (logits within 1e-4) and greedy decoding equal to `generate` token for token; the
paged cache holds each token's latent entry (kv_lora_rank + qk_rope_head_dim values, equal
to what transformers caches), not per-head K/V; DeepSeek's routers choose and weigh
experts as transformers' do; TP=2 on gloo ranks; configs Tandem cannot serve are refused
naming the field.

Cases: an MLA-only V3 (every layer dense), V3 with its grouped sigmoid router and shared
expert, V3 with yarn RoPE (DeepSeek's mscale in the softmax scale) in rotate_half layout
past the original context, V2 (complex RoPE, group-limited softmax router, two shared
experts) and a V2-Lite-like one (no q_lora_rank, greedy router, attention biases).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.model_config import ModelConfig
from common.moe_config import parse_deepseek_moe
from devtools.checkpoint_builder import TINY_MLA, build_checkpoint
from services.worker.kv_cache import KvCache
from services.worker.models.deepseek import latent_cache
from services.worker.models.moe import grouped_route
from services.worker.models.weight_loader import load_model
from tests.hf_reference import fresh_rope, hf_greedy, hf_log_softmax
from tests.unit.test_model_parity import PagedSession, random_tokens, reference_logits
from tests.unit.test_tensor_parallel_model import NEW_TOKENS, run_group

ATOL = RTOL = 1e-4
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
CASES = {
    "v3-mla-dense": {"architecture": "deepseek_v3", "moe": {"first_k_dense_replace": 2}},
    "v3-moe": {"architecture": "deepseek_v3", "seed": 22},
    "v3-yarn-half": {
        "architecture": "deepseek_v3",
        "max_position_embeddings": 128,
        "rope_scaling": YARN,
        "config_overrides": {"rope_interleave": False},
        "seed": 23,
    },
    "v2-moe": {"architecture": "deepseek_v2", "seed": 24},
    "v2-lite": {
        "architecture": "deepseek_v2",
        "moe": {"topk_method": "greedy", "n_group": 1, "topk_group": 1},
        "config_overrides": {"q_lora_rank": None, "attention_bias": True},
        "seed": 25,
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoint folders, built on first use."""
    built: dict[str, object] = {}

    def folder(name: str):
        if name not in built:
            kwargs = dict(CASES[name])
            arch = kwargs.pop("architecture")
            built[name] = build_checkpoint(tmp_path_factory.mktemp("ds") / name, arch, **kwargs)
        return built[name]

    return folder


@pytest.fixture(scope="module", params=list(CASES))
def case(request, folders):
    folder = folders(request.param)
    ours, config = load_model(folder, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return request.param, folder, ours, config, hf


def test_chunked_prefill_decodes_and_mixed_batch_match_hf(case) -> None:
    _, _, ours, config, hf = case
    seqs = [random_tokens(config, n, seed=100 + n) for n in (30, 21, 18)]
    expected = [reference_logits(hf, s) for s in seqs]
    session = PagedSession(ours, config, block_size=4)
    tables = [session.allocate(len(s)) for s in seqs]
    a, b, c = seqs
    steps = [
        [(0, a, 0, 11), (1, b, 0, 10)],  # two prompts' first chunks
        [(0, a, 11, 11), (1, b, 10, 10), (2, c, 0, 9)],  # chunks over cached prefixes
        [(0, a, 22, 1), (1, b, 20, 1), (2, c, 9, 9)],  # decodes beside a chunk
        *[[(0, a, pos, 1)] for pos in range(23, 30)],  # decodes
    ]
    for step in steps:
        work = [(tokens, computed, new, tables[i]) for i, tokens, computed, new in step]
        for (i, _, computed, new), got in zip(step, session.step(work), strict=True):
            torch.testing.assert_close(
                got, expected[i][computed : computed + new], atol=ATOL, rtol=RTOL
            )


def test_greedy_generation_matches_hf_generate(case) -> None:
    name, _, ours, config, hf = case
    prompt = random_tokens(config, 20, seed=7)  # with yarn: past the original 16 positions
    max_new = 24
    fresh_rope(hf)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
    reference = out[0, len(prompt) :].tolist()
    session = PagedSession(ours, config, block_size=4)
    table = session.allocate(len(prompt) + max_new)
    tokens, computed, new, generated = list(prompt), 0, len(prompt), []
    while len(generated) < max_new:
        (logits,) = session.step([(tokens, computed, new, table, len(prompt))])
        generated.append(int(logits[-1].argmax()))
        tokens.append(generated[-1])
        computed, new = len(tokens) - 1, 1
        if generated[-1] in config.eos_token_ids:
            break
    assert generated == reference, name
    assert len(set(generated)) >= 4, f"degenerate generation {generated}"


@pytest.mark.parametrize("case", ["v3-moe"], indirect=True)
def test_cache_holds_the_latent_entry_per_token(case) -> None:
    """Per token and layer the pool holds kv_lora_rank + qk_rope_head_dim values (one
    latent "head" of half that in K and in V), entry after entry, and they are what
    transformers caches: the normed latent and the rotated shared key part."""
    _, _, ours, config, hf = case
    mla = config.mla
    per_token = mla.kv_lora_rank + mla.qk_rope_head_dim
    assert (config.num_key_value_heads, 2 * config.head_dim) == (1, per_token)
    bytes_per_block = KvCache.bytes_per_block(4, config.num_hidden_layers, 1, config.head_dim,
                                              torch.float32)  # fmt: skip
    assert bytes_per_block == 4 * config.num_hidden_layers * per_token * 4
    full = config.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    assert per_token * 4 < full  # what per-head K and V would take: 160 + 96 per head here
    tokens = random_tokens(config, 13, seed=3)
    session = PagedSession(ours, config, block_size=4)
    table = session.allocate(len(tokens))
    session.step([(tokens, 0, 7, table)])
    session.step([(tokens, 7, 6, table)])
    with torch.no_grad():
        cached = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    for layer in range(config.num_hidden_layers):
        entries = latent_cache(*session.cache.layer(layer))[table].reshape(-1, per_token)
        latent, k_rope = cached.layers[layer].keys[0, 0], cached.layers[layer].values[0, 0]
        torch.testing.assert_close(entries[: len(tokens)], torch.cat([latent, k_rope], -1),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def _hf_router(architecture: str, moe_fields: dict, hidden: int):
    import transformers

    if architecture == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )

        config = transformers.DeepseekV3Config(hidden_size=hidden, **moe_fields)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as Router,
        )

        config = transformers.DeepseekV2Config(hidden_size=hidden, **moe_fields)
    return Router(config)


@pytest.mark.parametrize(
    "architecture, fields",
    [
        ("deepseek_v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}),
        ("deepseek_v3", {"n_group": 8, "topk_group": 3, "norm_topk_prob": False}),
        ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": True}),
        ("deepseek_v2", {"topk_method": "greedy"}),
        ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ],
    ids=["v3-4groups", "v3-8groups-unnormed", "v3-1group", "v2-greedy", "v2-groups"],
)
def test_router_chooses_and_weighs_as_hf(architecture, fields) -> None:
    fields = {"n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 8,
              "routed_scaling_factor": 2.5, **fields}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    router = _hf_router(architecture, fields, hidden=32)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = torch.randn(64, 32, generator=gen)
    moe = parse_deepseek_moe({**fields, "num_hidden_layers": 2, "first_k_dense_replace": 0},
                             architecture)  # fmt: skip
    logits, want_weights, want_experts = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, experts = grouped_route(logits, moe, bias)
    assert torch.equal(experts, want_experts)
    assert torch.equal(weights, want_weights)


@pytest.mark.parametrize("case", ["v3-moe"], indirect=True)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_tensor_parallel_two_ranks_equal_hf(case, expert_parallel, tmp_path) -> None:
    """Each rank holds half the heads (its q_b/kv_b rows, o_proj columns), half of every
    expert's inner dimension (or, with expert parallelism, half the experts whole), half
    the shared expert's, and the whole latent in its cache."""
    _, folder, _, _, _ = case
    prompt = [5, 17, 230, 9, 44, 101, 7]
    results = run_group(folder, 2, prompt, tmp_path, expert_parallel=expert_parallel)
    reference = hf_log_softmax(folder, prompt)[-1]
    for rank, tokens, logits, _, kv_heads, experts in results:
        assert tokens == hf_greedy(folder, prompt, NEW_TOKENS)
        assert kv_heads == 1  # the latent head, replicated
        held, shape = experts  # (experts held, stacked gate_up shape) of the first MoE layer
        assert (held, shape[0]) == ((range(4 * rank, 4 * rank + 4), 4) if expert_parallel
                                    else (range(8), 8))  # fmt: skip
        got = torch.log_softmax(torch.tensor(logits), dim=-1)
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["v3-moe"], indirect=True)
def test_pipeline_two_stages_equal_hf(case, tmp_path) -> None:
    """Stage 0 holds the dense layer 0, stage 1 the sparse layer 1 (each its own latent KV)."""
    from tests.unit.test_pipeline_parallel_model import NEW_TOKENS as PP_NEW
    from tests.unit.test_pipeline_parallel_model import run_group as run_stages

    _, folder, _, _, _ = case
    prompt = [5, 17, 230, 9, 44, 101, 7]
    results = run_stages(folder, 1, 2, prompt, tmp_path)
    want = hf_greedy(folder, prompt, PP_NEW)
    assert [tokens for _, tokens, _, _ in results] == [want, want]


@pytest.mark.parametrize("case", ["v3-moe"], indirect=True)
def test_bfloat16_keeps_the_router_bias_float32_and_tracks_hf(case) -> None:
    _, folder, _, config, hf = case
    model, _ = load_model(folder, dtype=torch.bfloat16)
    sparse = model.model.layers[1].mlp
    assert sparse.gate.e_score_correction_bias.dtype == torch.float32  # as transformers keeps it
    assert sparse.gate.weight.dtype == torch.bfloat16
    tokens = random_tokens(config, 20, seed=9)
    expected = reference_logits(hf, tokens)
    session = PagedSession(model, config, block_size=4, dtype=torch.bfloat16)
    table = session.allocate(len(tokens))
    got = [session.step([(tokens, 0, 12, table)])[0]]
    got += [session.step([(tokens, p, 1, table)])[0] for p in range(12, 20)]
    got = torch.cat(got)
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


BASE = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    **TINY_MLA,
}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_key_value_heads": 2}, "deepseek_v3 with num_key_value_heads=2 is not supported"),
        ({"kv_lora_rank": 31}, "kv_lora_rank \\+ qk_rope_head_dim must be even"),
        ({"qk_rope_head_dim": 15, "kv_lora_rank": 31}, "qk_rope_head_dim must be even"),
        ({"n_group": 3}, "n_group \\(3\\) must divide the number of experts \\(8\\)"),
        ({"n_group": 8}, "n_group \\(8\\) leaves 1 expert per group"),
        ({"topk_group": 5}, "topk_group \\(5\\) must not exceed n_group \\(4\\)"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"},
         "deepseek_v2 with topk_method='noaux_tc' is not supported"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a positive number"),
    ],
)  # fmt: skip
def test_unservable_configs_are_refused_naming_the_field(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **fields})


def test_dense_config_has_no_experts_and_kv_geometry_is_the_latent() -> None:
    config = ModelConfig.from_dict({**BASE, "first_k_dense_replace": 2})
    assert config.moe is None and config.mla.q_lora_rank == TINY_MLA["q_lora_rank"]
    assert (config.num_key_value_heads, config.head_dim, config.rope_head_dim) == (1, 24, 16)
    v2 = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v2", "q_lora_rank": None})
    assert v2.mla.q_lora_rank is None and v2.mla.rope_layout == "complex"
    assert v2.moe.routing == "softmax" and not v2.moe.norm_topk_prob
    assert v2.moe.shared_intermediate_size == 2 * 48  # DeepseekV2Config's 2 shared experts
