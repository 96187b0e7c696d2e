"""KV groups (`common.kv_groups`): which layers share a block table, each group's slots in a
pipeline stage's blocks, and how the parallel KV plans run over those slots
(`KvGeometry`)."""

import pytest

from common.kv_groups import KvGroups, kv_groups
from common.model_config import ModelConfig
from common.parallel_plan import Layout, layer_ranges
from common.sliding_window import gemma_layer_types
from services.worker.parallel.kv_ranks import KvGeometry


def test_layers_that_attend_alike_make_one_group() -> None:
    assert kv_groups(None, 4) == KvGroups((None,), ((0, 1, 2, 3),))
    assert kv_groups((8, 8, 8), 3) == KvGroups((8,), ((0, 1, 2),))
    one = kv_groups((8, None, 8, None), 4, hybrid=False)  # --disable-hybrid-kv-cache-manager
    assert one == KvGroups((None,), ((0, 1, 2, 3),)) and not one.is_hybrid
    assert kv_groups((8, 16), 2, hybrid=False).windows == (16,)  # all windowed: the widest


def test_gemma2_alternation_makes_two_groups_of_half_the_layers() -> None:
    groups = kv_groups((64, None) * 13, 26)
    assert groups.windows == (64, None) and groups.size == 13
    assert groups.layers == (tuple(range(0, 26, 2)), tuple(range(1, 26, 2)))
    assert groups.group_of(5) == 1 and groups.stage_slots(range(26))[1][5] == (1, 2)


def test_gemma3_pattern_cuts_the_sliding_layers_into_groups_as_large_as_the_full_one() -> None:
    types = gemma_layer_types({}, "gemma3_text", 26)  # every 6th layer full: 4 full, 22 sliding
    windows = tuple(None if t == "full_attention" else 512 for t in types)
    groups = kv_groups(windows, 26)
    assert groups.size == 4 and groups.num_groups == 7
    assert [len(g) for g in groups.layers] == [4, 4, 4, 4, 4, 2, 4]
    assert groups.windows == (512,) * 6 + (None,)
    assert groups.layers[-1] == (5, 11, 17, 23)
    assert sorted(sum(groups.layers, ())) == list(range(26))


def test_qwen2_max_window_layers_groups_come_from_the_model_config() -> None:
    raw = {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "use_sliding_window": True, "sliding_window": 16,
        "max_window_layers": 3,
    }  # fmt: skip
    groups = ModelConfig.from_dict(raw).kv_groups()
    assert groups.layers == ((0,), (1,), (2,), (3,)) and groups.windows == (None,) * 3 + (16,)
    assert ModelConfig.from_dict(raw).kv_groups(hybrid=False).num_groups == 1


def test_a_stage_holds_its_layers_in_slots_from_zero_per_group() -> None:
    groups = kv_groups((64, None, 64, None, 64), 5)  # 3 sliding, 2 full: groups of 2
    assert groups.layers == ((0, 2), (4,), (1, 3)) and groups.size == 2
    assert groups.stage_slots(range(5)) == (2, ((0, 0), (2, 0), (0, 1), (2, 1), (1, 0)))
    # a second stage of layers 3..4: the full group's layer 3 and the third group's layer 4
    assert groups.stage_slots(range(3, 5)) == (1, ((2, 0), (1, 0)))
    # slot s is final once every layer in it is: slot 0 holds layers 0, 1 and 4
    assert [groups.slots_done(range(5), done) for done in range(6)] == [0, 0, 0, 0, 0, 2]
    assert [groups.slots_done(range(4), done) for done in range(5)] == [0, 0, 1, 1, 2]


def test_parallel_plans_run_over_slots_and_refuse_different_stage_splits() -> None:
    groups = kv_groups((64, None) * 4, 8)  # two groups of 4 layers
    geometry = KvGeometry(4, 2, 8, 16, 8, groups)
    assert geometry.stage_ranges(1) == [range(0, 4)]
    assert geometry.stage_ranges(2) == [range(0, 2), range(2, 4)]  # 2 slots per stage
    assert geometry.block_shape(Layout(tp=2, pp=2), 3) == (2, 2, 16, 1, 8)
    plan = geometry.plan(Layout(tp=2, pp=2), Layout(tp=1, pp=2))
    assert {p.layers for p in plan} == {range(0, 2), range(2, 4)}
    # layers done on the model: the slots behind them (stage 1 starts at layer 4, slot 2)
    assert [geometry.axis_done(d, 2) for d in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    with pytest.raises(ValueError, match="same pipeline_parallel_size"):
        geometry.plan(Layout(pp=2), Layout(pp=1))
    plain = KvGeometry(4, 2, 8, 16, 8)
    assert plain.stage_ranges(2) == layer_ranges(8, 2)
    assert plain.axis_done(5, 2) == 5


def test_the_scheduler_refuses_grouped_workers_split_into_different_stages() -> None:
    import dataclasses

    from services.scheduler.bootstrap import check_compatible
    from tests.fake_worker import worker_info

    def grouped(worker_id: str, pp: int):
        info = worker_info(worker_id, "decode")
        model = dataclasses.replace(info.model, kv_group_windows=(8, 0))
        return dataclasses.replace(info, model=model, pipeline_parallel_size=pp)

    check_compatible([grouped("a", 2), grouped("b", 2)])
    with pytest.raises(ValueError, match="same pipeline_parallel_size only: a has 1, b 2"):
        check_compatible([grouped("a", 1), grouped("b", 2)])
    with pytest.raises(ValueError, match="disagree on model kv_group_windows"):
        plain = worker_info("c", "decode")
        check_compatible([grouped("a", 1), plain])
