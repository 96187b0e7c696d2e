"""Layer-wise KV loads' connector point (`wait_for_layer_load`, issue 45): a forward pass
asks for each layer of the pool before that layer's attention reads it, and the point
costs nothing where no connector loads layer by layer (a CPU worker, with a tier or not;
beside a GPU, `tests/gpu/test_kv_offload_gpu.py`)."""

from __future__ import annotations

import torch

from common.step_plan import BlockMoves
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector, KvConnectors
from services.worker.kv_offload_connector import OffloadConnector
from services.worker.kv_side_stream import slot_order, slot_rows
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.weight_loader import load_model

BLOCK = 4


def pool_for(config, num_blocks: int) -> KvCache:
    return KvCache(
        num_blocks=num_blocks, block_size=BLOCK, num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=torch.float32,
    )  # fmt: skip


@torch.inference_mode()
def forward(model, pool: KvCache, tokens: list[int], computed: int, table: list[int]):
    """The last token's logits of a pass computing `tokens` after `computed` cached ones."""
    slices = [SequenceSlice(computed, len(tokens), table, computed + len(tokens))]
    positions, meta = build_attention_metadata(slices, BLOCK, "cpu")
    return model.compute_logits(model(torch.tensor(tokens), positions, pool, meta)[-1:])


def test_each_layer_is_asked_for_before_its_attention_reads_the_pool(tiny_llama_dir):
    """A tier holds a prompt's first 3 blocks (real KV, from a pass over them). One pass
    loads them whole before it runs; another loads each layer's slot only when the pass
    asks for that layer: the logits are bit-equal, so no layer read the pool before it
    asked (it would have read zeros), and each layer asks once, in order."""
    model, config = load_model(tiny_llama_dir, dtype=torch.float32)
    prompt = [(7 * i + 3) % config.vocab_size for i in range(3 * BLOCK + 5)]
    prefix, rest = prompt[: 3 * BLOCK], prompt[3 * BLOCK :]
    pool, tier = pool_for(config, 12), pool_for(config, 3)
    forward(model, pool, prefix, 0, [1, 2, 3])
    tier.copy_blocks([(1, 0), (2, 1), (3, 2)], source=pool)
    pairs = [(0, 5), (1, 6), (2, 8)]  # a run of two, then one
    table = [5, 6, 8, 9, 10]

    pool.data.zero_()
    pool.copy_blocks(pairs, source=tier)
    whole = forward(model, pool, rest, len(prefix), table)

    pool.data.zero_()
    asked: list[int] = []

    def load_layer(index: int) -> None:
        asked.append(index)
        slot = pool.layer_slots[index][1]
        for s, d in pairs:
            pool.data[d, slot] = tier.data[s, slot]

    pool.on_layer_needed = load_layer
    by_layer = forward(model, pool, rest, len(prefix), table)
    assert asked == list(range(config.num_hidden_layers))
    assert torch.equal(by_layer, whole)

    pool.data.zero_()
    asked.clear()
    pool.on_layer_needed = None  # asked for nothing: the pass reads what is there
    unloaded = forward(model, pool, rest, len(prefix), table)
    assert not asked and not torch.equal(unloaded, whole)


def test_a_pass_that_reads_every_layer_at_once_asks_for_each_first():
    pool = KvCache(num_blocks=2, block_size=4, num_layers=3, num_kv_heads=1, head_dim=8,
                   dtype=torch.float32)  # fmt: skip
    pool.all_layers_needed()  # no connector loads layers: nothing to ask
    asked: list[int] = []
    pool.on_layer_needed = asked.append
    pool.all_layers_needed()
    assert asked == [0, 1, 2]


class LayerWaits(KvConnector):
    """A connector that notes the layers it is asked to wait for."""

    def __init__(self, loads_layers: bool) -> None:
        self.loads_layers = loads_layers
        self.waited: list[int] = []

    def wait_for_layer_load(self, layer: int) -> None:
        self.waited.append(layer)


def test_only_connectors_that_load_layers_are_asked_to_wait():
    loader, other = LayerWaits(True), LayerWaits(False)
    both = KvConnectors([other, loader])
    assert both.loads_layers
    both.wait_for_layer_load(0)
    both.wait_for_layer_load(1)
    assert loader.waited == [0, 1] and other.waited == []
    assert not KvConnectors([other, KvConnector()]).loads_layers


def test_a_cpu_offload_tier_loads_whole_blocks_and_sets_no_layer_hook(tiny_llama_dir):
    """On CPU, loading layer by layer beside the pass was measured slower than whole loads
    (`bench.kv_layer_loads`): the tier's connector does not ask for the layer point."""
    _, config = load_model(tiny_llama_dir, dtype=torch.float32)
    pool, tier = pool_for(config, 6), pool_for(config, 3)
    tier.data.copy_(torch.randn(tier.data.shape))
    connector = OffloadConnector(pool, tier)
    assert not connector.loads_layers and not KvConnectors([connector]).loads_layers
    connector.start_load_kv(BlockMoves(offload_in=[(2, 4), (0, 1)]), step_id=1)
    assert torch.equal(pool.data[4], tier.data[2]) and torch.equal(pool.data[1], tier.data[0])
    assert connector.get_finished()["offload_load_seconds"] >= 0


def test_slots_are_loaded_in_the_order_the_layers_read_them():
    assert slot_order(((0, 0), (0, 1), (0, 2)), 3) == [0, 1, 2]
    # two KV groups sharing slots, and a slot no layer of this stage reads (still copied)
    assert slot_order(((0, 1), (1, 1), (0, 0), (1, 0)), 3) == [1, 0, 2]


def test_a_slot_of_a_run_of_blocks_is_rows_one_block_apart():
    """What a pitched copy moves for one slot of a run: `rows` spans of the slot's bytes,
    one block apart (the pitch given to `cudaMemcpy2DAsync`), in place in the pool."""
    pool = KvCache(num_blocks=6, block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                   dtype=torch.bfloat16)  # fmt: skip
    pool.data.copy_(torch.randn(pool.data.shape))
    rows = slot_rows(pool)[2:5, 1]
    assert rows.shape == (3, pool.block_bytes // 3) and rows.stride() == (pool.block_bytes, 1)
    assert rows.data_ptr() == pool.data[2, 1].data_ptr()
    assert torch.equal(rows, pool.bytes[2:5, 1].reshape(3, -1))
