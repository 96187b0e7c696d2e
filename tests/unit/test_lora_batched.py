"""Multi-LoRA on the worker's model, against PEFT: three adapters made with PEFT (different
targets, ranks, alpha and rsLoRA; random A and B) and the base model decode together in one
batch, every step mixing all four, and each sequence's greedy tokens equal HF + PEFT's
merged model's token for token; logits per sequence match to float rounding. Adapters PEFT
can make but this server cannot apply are refused naming why, and slots are bounded."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.lora.adapter import LoraAdapterError, load_adapter
from services.worker.lora.manager import LoraManager
from services.worker.models.weight_loader import load_model
from tests.unit.test_model_parity import PagedSession

ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all4-rs": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "mlp16": dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 230, 44, 9], [310, 12, 8, 77], [501, 3, 66, 21, 90, 14], [7, 7, 300]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        peft = get_peft_model(base, config)
        with torch.no_grad():  # PEFT's random init is small; make the updates matter
            for param_name, param in peft.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(20.0)
        peft.save_pretrained(root / name)
        out[name] = root / name
    return out


def peft_merged_greedy(base_dir, adapter_dir, prompt, max_new_tokens: int = NEW_TOKENS):
    from peft import PeftModel

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        hf = PeftModel.from_pretrained(hf, adapter_dir).merge_and_unload()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def test_three_adapters_and_the_base_in_one_batch_equal_peft(tiny_llama_dir, adapters):
    model, config = load_model(tiny_llama_dir, torch.float32)
    manager = LoraManager(model, max_loras=4, max_rank=16)
    for name, folder in adapters.items():
        manager.register(load_adapter(name, folder, config.num_hidden_layers))
    names = [*adapters, None]  # one sequence per adapter, one on the base model
    session = PagedSession(model, config, block_size=4)
    tables = [session.allocate(len(p) + NEW_TOKENS) for p in PROMPTS]
    tokens = [list(p) for p in PROMPTS]
    work = [(t, 0, len(t), table) for t, table in zip(tokens, tables, strict=True)]
    generated = [[] for _ in PROMPTS]
    for _ in range(NEW_TOKENS):
        per_token = [names[i] for i, (_, done, new, _) in enumerate(work) for _ in range(new)]
        manager.set_pass(per_token)
        rows = session.step(work)
        manager.clear_pass()
        for i, logits in enumerate(rows):
            generated[i].append(int(logits[-1].argmax()))
            tokens[i].append(generated[i][-1])
        work = [(t, len(t) - 1, 1, table) for t, table in zip(tokens, tables, strict=True)]
    for i, name in enumerate(names):
        expected = peft_merged_greedy(tiny_llama_dir, adapters.get(name), PROMPTS[i])
        assert generated[i] == expected, name
    assert len({tuple(g) for g in generated}) == len(names)  # the adapters changed outputs


def test_adapter_logits_match_the_merged_weights(tiny_llama_dir, adapters):
    from peft import PeftModel

    model, config = load_model(tiny_llama_dir, torch.float32)
    manager = LoraManager(model, max_loras=2, max_rank=16)
    manager.register(load_adapter("mlp16", adapters["mlp16"], config.num_hidden_layers))
    prompt = PROMPTS[2]
    session = PagedSession(model, config, block_size=4)
    manager.set_pass(["mlp16"] * len(prompt))
    (ours,) = session.step([(prompt, 0, len(prompt), session.allocate(len(prompt)))])
    manager.clear_pass()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, adapters["mlp16"]).merge_and_unload()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"r": 128}, "rank r=128"),
        ({"bias": "all"}, "bias='all'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "['embed_tokens']"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "'IA3'"),
    ],
)
def test_adapters_this_server_cannot_apply_are_refused(adapters, tmp_path, change, named):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(adapters["qv8"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraAdapterError) as refused:
        load_adapter("bad", folder, num_layers=2)
    assert named in str(refused.value) and "'bad'" in str(refused.value)


def test_slots_are_bounded_and_least_recently_used_adapters_make_room(tiny_llama_dir, adapters):
    """Two slots, three adapters held: a pass brings its adapters in, evicting the least
    recently used one it does not need, and still equals PEFT afterwards."""
    model, config = load_model(tiny_llama_dir, torch.float32)
    manager = LoraManager(model, max_loras=2, max_rank=16, max_cpu_loras=3)
    loaded = {n: load_adapter(n, f, config.num_hidden_layers) for n, f in adapters.items()}
    for adapter in loaded.values():
        manager.register(adapter)
    with pytest.raises(ValueError, match="3 LoRA adapters in one step"):
        manager.set_pass(list(loaded))
    manager.set_pass(["qv8", "all4-rs"])
    manager.set_pass(["qv8"])  # all4-rs is now the least recently used
    manager.set_pass(["mlp16", "qv8"])
    assert dict(manager._slots) == {"qv8": 0, "mlp16": 1}
    manager.clear_pass()
    prompt = PROMPTS[1]
    session = PagedSession(model, config, block_size=4)
    manager.set_pass(["mlp16"] * len(prompt))
    (ours,) = session.step([(prompt, 0, len(prompt), session.allocate(len(prompt)))])
    from peft import PeftModel

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, adapters["mlp16"]).merge_and_unload()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    with pytest.raises(KeyError, match="not loaded"):
        manager.set_pass(["nope"])
    one = LoraManager(load_model(tiny_llama_dir, torch.float32)[0], 1, 16, max_cpu_loras=1)
    one.register(loaded["qv8"])
    with pytest.raises(ValueError, match="max-cpu-loras"):
        one.register(loaded["mlp16"])
    small = LoraManager(load_model(tiny_llama_dir, torch.float32)[0], 1, max_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        small.register(loaded["qv8"])


def test_run_time_adds_removes_and_rereads_evicted_adapters(tiny_llama_dir, adapters):
    """Adapters added by folder at run time; beyond max_cpu_loras the least recently used
    leaves memory and is read again when a pass needs it; a removed name is refused; a name
    added from another folder serves the new adapter (its slot refilled)."""
    from peft import PeftModel

    model, config = load_model(tiny_llama_dir, torch.float32)
    reads = []

    def read(name, path):
        reads.append(name)
        return load_adapter(name, path, config.num_hidden_layers)

    manager = LoraManager(model, max_loras=1, max_rank=16, max_cpu_loras=1, load=read)
    assert manager.add("a", str(adapters["qv8"]))
    assert not manager.add("a", str(adapters["qv8"]))  # already served from there
    manager.add("b", str(adapters["mlp16"]))
    assert manager.names == ["a", "b"] and manager.held == ["b"] and reads == ["a", "b"]
    prompt = PROMPTS[0]

    def logits(name):
        manager.set_pass([name] * len(prompt))
        session = PagedSession(model, config, block_size=4)
        (rows,) = session.step([(prompt, 0, len(prompt), session.allocate(len(prompt)))])
        manager.clear_pass()
        return rows

    def peft(folder):
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        hf = PeftModel.from_pretrained(hf, folder).merge_and_unload()
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0]

    torch.testing.assert_close(logits("a"), peft(adapters["qv8"]), atol=1e-4, rtol=1e-4)
    assert reads == ["a", "b", "a"] and manager.held == ["a"]  # read again, b evicted
    assert manager.remove("a") and not manager.remove("a")
    with pytest.raises(KeyError, match="not loaded"):
        manager.set_pass(["a"])
    torch.testing.assert_close(logits("b"), peft(adapters["mlp16"]), atol=1e-4, rtol=1e-4)
    manager.add("b", str(adapters["all4-rs"]))  # same name, another folder: replaced
    torch.testing.assert_close(logits("b"), peft(adapters["all4-rs"]), atol=1e-4, rtol=1e-4)
