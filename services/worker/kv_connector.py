"""The worker side of a KV connector, in vLLM V1's shape: whatever moves KV into or out of
this worker's pool from outside it (another worker, the offload tiers) is called at the
same fixed points of every step, and reports what finished with the step's result.

    start_load_kv(moves, step_id)  before the forward pass (after the swaps, before the
                                   copy-on-write copies, which may read a loaded block)
    wait_for_layer_load(layer)     before a layer's attention reads the pool (only
                                   connectors with `loads_layers`; this stage's layer
                                   index, `KvCache.on_layer_needed`)
    save_kv_layer(layer)           as the forward pass writes each layer's KV (only
                                   connectors with `saves_layers`; the model's layer number)
    wait_for_save(moves, step_id)  after the forward pass
    get_finished()                 what finished during the step: `StepResult` fields

What a connector moves in a step comes in the step plan (`BlockMoves`, the connector
metadata of vLLM's scheduler output); the scheduler side is `services/scheduler`'s
(`kv_offload.HostOffload` for the tiers, `handoff.KvHandoff` for peers). All of these run
on the tensor thread, ordered with the steps. `reset` runs there too when the worker forgets
every request; `close` on the event loop at exit.

The connectors: `OffloadConnector` (host memory, then disk) and `PeerKvConnector` (KV
between workers: the same-host pull, UCX, and UCX between workers of different layouts).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.step_plan import BlockMoves


class KvConnector:
    """A connector's step hooks; each does nothing unless the connector needs it."""

    saves_layers = False  # save_kv_layer is called only when some connector sets this
    loads_layers = False  # wait_for_layer_load likewise

    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        pass

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        pass

    def get_finished(self) -> dict:
        return {}

    def reset(self) -> None:
        pass

    async def close(self) -> None:
        pass


class KvConnectors(KvConnector):
    """Several connectors called in order at each point; their results merged."""

    def __init__(self, connectors: Sequence[KvConnector]) -> None:
        self.connectors = tuple(connectors)
        self._layers = tuple(c for c in self.connectors if c.saves_layers)
        self.saves_layers = bool(self._layers)
        self._loaders = tuple(c for c in self.connectors if c.loads_layers)
        self.loads_layers = bool(self._loaders)

    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        for connector in self.connectors:
            connector.start_load_kv(moves, step_id)

    def wait_for_layer_load(self, layer: int) -> None:
        for connector in self._loaders:
            connector.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for connector in self._layers:
            connector.save_kv_layer(layer)

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        for connector in self.connectors:
            connector.wait_for_save(moves, step_id)

    def get_finished(self) -> dict:
        finished: dict = {}
        for connector in self.connectors:
            finished.update(connector.get_finished())
        return finished

    def reset(self) -> None:
        for connector in self.connectors:
            connector.reset()

    async def close(self) -> None:
        for connector in self.connectors:
            await connector.close()
