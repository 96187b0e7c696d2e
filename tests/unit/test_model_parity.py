"""Our paged llama-family model against transformers' eager implementation.

Every step (chunked prefill across block boundaries, single-token decodes, and a mixed batch
of prefilling and decoding sequences) runs through a KvCache whose block tables are shuffled
and non-contiguous, and its logits are compared with HF's full-sequence forward at the same
positions. Greedy decoding must equal `generate(do_sample=False)` token for token.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_config import ModelConfig
from devtools.checkpoint_builder import build_checkpoint
from kernels import cpu_paged_attention
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.rope import RotaryEmbedding
from services.worker.models.weight_loader import load_model
from tests.hf_reference import fresh_rope

ATOL = RTOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# case -> (conftest fixture name, or build_checkpoint kwargs for a module-local checkpoint)
CASES: dict[str, str | dict] = {
    "llama": "tiny_llama_dir",
    "qwen2": "tiny_qwen2_dir",
    "qwen3": "tiny_qwen3_dir",
    "llama3-rope": {"architecture": "llama", "rope_scaling": LLAMA3_ROPE},
    "linear-rope": {
        "architecture": "llama",
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    # Past a small original context: yarn rotates statically; dynamic (past its
    # max_position_embeddings of 16, up to 16 x 8 = 128) and longrope (past 16) depend on
    # each request's prompt length and position (see models/rope.py).
    "yarn-rope": {
        "architecture": "qwen2",
        "max_position_embeddings": 128,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "dynamic-rope": {
        "architecture": "llama",
        "max_position_embeddings": 16,
        "rope_scaling": {"rope_type": "dynamic", "factor": 8.0},
    },
    "longrope": {
        "architecture": "llama",
        "max_position_embeddings": 128,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
            "original_max_position_embeddings": 16,
        },
    },
    "tied": {"architecture": "llama", "tie_word_embeddings": True, "seed": 3},
    "mistral": {"architecture": "mistral", "seed": 1},
    "mixtral": "tiny_mixtral_dir",
    "qwen3_moe": "tiny_qwen3_moe_dir",
    # every other layer sparse, top-k weights not renormalised (Qwen3MoeConfig's default)
    "qwen3_moe-step2": {
        "architecture": "qwen3_moe",
        "num_hidden_layers": 3,
        "moe": {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []},
        "seed": 4,
    },
    # Sliding windows shorter than the prompts and the generations (HF's rule: W positions,
    # the query's own included): every layer (mistral, qwen3_moe), and qwen2's layers from
    # max_window_layers on (layer 0 full, layer 1 windowed).
    "mistral-window": {"architecture": "mistral", "sliding_window": 8, "seed": 5},
    "qwen2-window": {
        "architecture": "qwen2",
        "sliding_window": 6,
        "max_window_layers": 1,
        "seed": 6,
    },
    "qwen3_moe-window": {"architecture": "qwen3_moe", "sliding_window": 7, "seed": 7},
    # Gemma 3 text: sliding / full / sliding layers (window 6), local RoPE (theta 1e4) on the
    # sliding ones, linear-scaled global RoPE (theta 1e6) on the full one, q/k norms.
    "gemma3": {
        "architecture": "gemma3_text",
        "num_hidden_layers": 3,
        "sliding_window": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "config_overrides": {
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]
        },
        "seed": 8,
    },
    # Gemma 2: the config class's soft-caps (50 / 30) and scale; and caps and a scale small
    # enough that every score and logit is bent (1.0 / 3.0, query_pre_attn_scalar 8). (Tied
    # random Gemmas repeat one token: tying is checked in test_gemma.py.)
    "gemma2": {"architecture": "gemma2", "num_hidden_layers": 3, "sliding_window": 6, "seed": 9},
    "gemma2-capped": {
        "architecture": "gemma2",
        "num_hidden_layers": 3,
        "sliding_window": 6,
        "config_overrides": {
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 8,
        },
        "seed": 10,
    },
    # gpt-oss: sliding / full / sliding layers (window 6) with attention sinks, biased q/k/v/o,
    # YaRN RoPE (truncate false), 4 biased experts (top 2 of the biased router's logits,
    # softmaxed over the 2) with the clamped SwiGLU, in transformers' own (unquantized)
    # layout; MXFP4 experts: test_gpt_oss.py.
    "gpt_oss": {
        "architecture": "gpt_oss",
        "num_hidden_layers": 3,
        "sliding_window": 6,
        "rope_scaling": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
        "seed": 12,
    },
}


class PagedSession:
    """Drives our model over a KvCache, handing out blocks in a shuffled order."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.cache = KvCache(
            num_blocks=256,
            block_size=block_size,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )
        order = torch.randperm(256, generator=torch.Generator().manual_seed(block_size))
        self.free = order.tolist()

    def allocate(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.cache.block_size)
        table, self.free = self.free[:count], self.free[count:]
        return table

    def step(self, work: Sequence[tuple]) -> list[torch.Tensor]:
        """work: (all token ids, num_computed, num_new, block table[, prompt length]) per
        sequence; the prompt length defaults to all the tokens (as in HF's forward of them).

        Returns each sequence's float32 logits for its new tokens.
        """
        ids: list[int] = []
        slices = []
        for tokens, computed, new, table, *prompt in work:
            ids.extend(tokens[computed : computed + new])
            slices.append(SequenceSlice(computed, new, table, prompt[0] if prompt else len(tokens)))
        positions, meta = build_attention_metadata(slices, self.cache.block_size, "cpu")
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), positions, self.cache, meta)
            logits = self.model.compute_logits(hidden)
        starts = meta.query_start_loc
        return [logits[starts[i] : starts[i + 1]] for i in range(len(work))]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, our model, config, HF model) for one checkpoint flavour."""
    spec = CASES[request.param]
    if isinstance(spec, str):
        folder = request.getfixturevalue(spec)
    else:
        kwargs = dict(spec)
        architecture = kwargs.pop("architecture")
        folder = build_checkpoint(
            tmp_path_factory.mktemp("parity") / request.param, architecture, **kwargs
        )
    ours, config = load_model(folder, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return request.param, folder, ours, config, hf


def reference_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    fresh_rope(hf)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(config: ModelConfig, count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (count,), generator=generator).tolist()


@pytest.mark.parametrize("block_size", [16, 4])
def test_chunked_prefill_then_decode_matches_hf(case, block_size: int) -> None:
    _, _, ours, config, hf = case
    tokens = random_tokens(config, 30, seed=block_size)
    expected = reference_logits(hf, tokens)
    session = PagedSession(ours, config, block_size)
    table = session.allocate(len(tokens))
    assert table != sorted(table), "block table should be shuffled"
    # Two prefill chunks (the second crosses the block boundary at 16), then 8 decodes.
    schedule = [(0, 11), (11, 11)] + [(pos, 1) for pos in range(22, 30)]
    for computed, new in schedule:
        (got,) = session.step([(tokens, computed, new, table)])
        torch.testing.assert_close(got, expected[computed : computed + new], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_of_prefills_and_decodes_matches_hf(case, block_size: int) -> None:
    _, _, ours, config, hf = case
    seqs = [random_tokens(config, n, seed=100 + n) for n in (15, 21, 18)]
    expected = [reference_logits(hf, s) for s in seqs]
    session = PagedSession(ours, config, block_size)
    tables = [session.allocate(len(s)) for s in seqs]
    a, b, c = seqs
    steps = [
        # A prefills 13 tokens while B prefills its first 10.
        [(0, a, 0, 13), (1, b, 0, 10)],
        # A decodes, B continues its prefill, C starts prefilling.
        [(0, a, 13, 1), (1, b, 10, 10), (2, c, 0, 9)],
        # A and B decode while C prefills the rest.
        [(0, a, 14, 1), (1, b, 20, 1), (2, c, 9, 9)],
    ]
    for step in steps:
        work = [(tokens, computed, new, tables[i]) for i, tokens, computed, new in step]
        outputs = session.step(work)
        for (i, _, computed, new), got in zip(step, outputs, strict=True):
            torch.testing.assert_close(
                got, expected[i][computed : computed + new], atol=ATOL, rtol=RTOL
            )


def test_greedy_generation_matches_hf_generate(case) -> None:
    _, folder, ours, config, hf = case
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The lighthouse keeper kept a ledger of ships")["input_ids"]
    max_new = 24
    fresh_rope(hf)
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)[
            0, len(prompt) :
        ].tolist()

    session = PagedSession(ours, config, block_size=4)
    table = session.allocate(len(prompt) + max_new)
    tokens = list(prompt)
    computed, new = 0, len(prompt)
    generated: list[int] = []
    while len(generated) < max_new:
        (logits,) = session.step([(tokens, computed, new, table, len(prompt))])
        token = int(logits[-1].argmax())
        generated.append(token)
        tokens.append(token)
        computed, new = len(tokens) - 1, 1
        if token in config.eos_token_ids:
            break
    assert generated == reference
    assert len(set(generated)) >= 4, f"degenerate generation {generated}"


@pytest.mark.parametrize("case", ["yarn-rope", "dynamic-rope", "longrope"], indirect=True)
def test_scaled_rope_past_the_original_context_matches_hf_generate(case) -> None:
    """Two requests batched together, chunked: one whose 26-token prompt is past the
    original context (16) from the start, prefilled 7 tokens a step, and one whose 10-token
    prompt crosses it while it generates. Each equals its own HF `generate` token for
    token: under dynamic and longrope RoPE, its prompt's keys rotated as of the prompt's
    length and each new token's as of its position + 1, whatever the step held."""
    _, _, ours, config, hf = case
    max_new, chunk = 20, 7
    prompts = [random_tokens(config, 26, seed=11), random_tokens(config, 10, seed=12)]
    expected = []
    for prompt in prompts:
        fresh_rope(hf)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
        expected.append(out[0, len(prompt) :].tolist())
    session = PagedSession(ours, config, block_size=4)
    tables = [session.allocate(len(p) + max_new) for p in prompts]
    tokens = [list(p) for p in prompts]
    computed, generated = [0, 0], [[], []]
    while True:
        active = [
            i
            for i in range(2)
            if len(generated[i]) < max_new
            and not (generated[i] and generated[i][-1] in config.eos_token_ids)
        ]
        if not active:
            break
        news = {i: min(chunk, len(tokens[i]) - computed[i]) for i in active}
        work = [(tokens[i], computed[i], news[i], tables[i], len(prompts[i])) for i in active]
        for i, logits in zip(active, session.step(work), strict=True):
            computed[i] += news[i]
            if computed[i] == len(tokens[i]):  # caught up: sample the next token
                token = int(logits[-1].argmax())
                generated[i].append(token)
                tokens[i].append(token)
    assert generated == expected
    assert all(len(set(g)) >= 4 for g in generated), f"degenerate generation {generated}"


def test_float32_cpu_layers_rotate_and_write_in_one_call(case, monkeypatch) -> None:
    """The greedy-equality tests above run through the fused C++ rotate-and-write wherever
    it applies: every layer of a float32 CPU model without per-head q/k norms (qwen3 has
    them, and takes the separate steps)."""
    name, _, ours, config, _ = case
    real = cpu_paged_attention.rotate_and_write
    fused = []

    def counting(*args):
        result = real(*args)
        fused.append(result is not None)
        return result

    monkeypatch.setattr(cpu_paged_attention, "rotate_and_write", counting)
    session = PagedSession(ours, config, block_size=4)
    tokens = random_tokens(config, 9, seed=5)
    session.step([(tokens, 0, len(tokens), session.allocate(len(tokens)))])
    expected = 0 if config.qk_norm else config.num_hidden_layers
    assert fused == [True] * expected, name


def test_tied_embeddings_are_the_head(case) -> None:
    """A tied head is the embedding matrix (on CPU a transposed copy of it, which its packed
    GEMM reads at full bandwidth); an untied one is not."""
    _, _, ours, config, _ = case
    head = ours.lm_head.weight
    head = head.t() if ours.lm_head.transposed else head
    same = head.shape == ours.model.embed_tokens.weight.shape and torch.equal(
        head, ours.model.embed_tokens.weight
    )
    assert same == config.tie_word_embeddings


def test_loaded_model_is_frozen_eval(tiny_qwen3_dir: Path) -> None:
    model, config = load_model(tiny_qwen3_dir, dtype=torch.bfloat16)
    assert config.architecture == "qwen3" and config.qk_norm
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_bfloat16_model_tracks_float32_reference(tiny_llama_dir: Path) -> None:
    model, config = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokens = random_tokens(config, 20, seed=7)
    expected = reference_logits(hf, tokens)
    session = PagedSession(model, config, block_size=8, dtype=torch.bfloat16)
    table = session.allocate(len(tokens))
    (prefill,) = session.step([(tokens, 0, 12, table)])
    decodes = [session.step([(tokens, pos, 1, table)])[0] for pos in range(12, 20)]
    got = torch.cat([prefill, *decodes])
    assert got.dtype == torch.float32
    # bf16 keeps 2-3 significant digits through two layers (measured: ~4% of the largest logit).
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 0.1 * scale
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.75


def _single_file_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_loader_rejects_missing_weight(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    folder = _single_file_copy(tiny_qwen2_dir, tmp_path / "broken")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 weights.*k_proj\.bias"):
        load_model(folder, dtype=torch.float32)


def test_loader_rejects_unexpected_weight_but_ignores_inv_freq(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    folder = _single_file_copy(tiny_qwen2_dir, tmp_path / "extra")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, folder / "model.safetensors")
    load_model(folder, dtype=torch.float32)  # inv_freq buffers are tolerated
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2, 2)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected 1 weights.*extra_proj"):
        load_model(folder, dtype=torch.float32)


def test_loader_rejects_wrong_shape_and_missing_files(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    folder = _single_file_copy(tiny_qwen2_dir, tmp_path / "shape")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_model(folder, dtype=torch.float32)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(folder, dtype=torch.float32)


def test_model_rejects_mismatched_cache(tiny_qwen2_dir: Path) -> None:
    model, config = load_model(tiny_qwen2_dir, dtype=torch.float32)
    cache = KvCache(
        8,
        4,
        config.num_hidden_layers + 1,
        config.num_key_value_heads,
        config.head_dim,
        torch.float32,
    )
    positions, meta = build_attention_metadata([SequenceSlice(0, 2, [0])], 4, "cpu")
    with pytest.raises(ValueError, match="KV cache geometry"):
        model(torch.tensor([5, 6]), positions, cache, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        LLAMA3_ROPE,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=str,
)
def test_rope_is_bit_identical_to_hf(scaling: dict | None, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    rope = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf_config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=rope
    )
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    q = torch.randn(512, 4, 32).to(dtype)
    k = torch.randn(512, 2, 32).to(dtype)
    cos, sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(32, 512, 500000.0, scaling)
    q_out, k_out = ours(positions, q, k)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_out, k_ref[0].transpose(0, 1))
