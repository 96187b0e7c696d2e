"""`python -m services.worker.parallel.peer`: rank 1..N-1 of a parallel worker, started by
rank 0 (never by hand). It joins the group, loads its slice of the model and its slice of
the KV pool (same block ids as rank 0), then runs every step rank 0 sends: the same batch
bookkeeping and block moves, the forward pass with its collectives, and rank 0's sampled
tokens in place of sampling. Between steps it runs its part of KV transfers over UCX with
a UCX worker of its own (`peer_kv.py`). It has no gRPC server; it ends when rank 0's pipe
closes."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from common.config import load_config
from common.lifecycle import freeze_startup_heap
from common.log import get_logger, setup_logging
from common.model_config import ModelConfig
from common.pb.tandem.internal.v1 import worker_pb2
from common.step_plan_pb import plan_from_pb
from services.worker.batch import PersistentBatch, PlanError
from services.worker.block_moves import check_moves, run_copies, run_swaps
from services.worker.config import WorkerConfig
from services.worker.kv_offload_connector import OffloadConnector
from services.worker.kv_transfer import TransferDeadline
from services.worker.parallel.kv_ranks import KvGeometry
from services.worker.parallel.peer_kv import KV_KINDS, RankKv
from services.worker.parallel.rank_channel import RESET, STEP, read_messages
from services.worker.parallel.rank_context import join_group, peer_store
from services.worker.runner import ModelRunner
from services.worker.startup import load_worker


def pool_axis_start(loaded, layout, stage: int) -> int:
    """Where this rank's pool starts on the layer axis a layout transfer's slices use: its
    stage's first layer, or with KV groups its first slot (`KvGeometry.stage_ranges`)."""
    c = loaded.model_config
    geometry = KvGeometry(
        c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers,
        loaded.kv_cache.block_size, c.head_dim, loaded.kv_groups,
    )  # fmt: skip
    return geometry.stage_ranges(layout.pp)[stage].start


def serve_steps(
    step_fd: int,
    runner: ModelRunner,
    batch: PersistentBatch,
    loaded,
    kv: RankKv | None,
    log,
    agree=None,
) -> None:
    offload = None  # the offload tiers' loads and saves on this rank's slice
    if loaded.offload_cache is not None:
        offload = OffloadConnector(
            loaded.kv_cache, loaded.offload_cache, loaded.disk_offload, agree
        )
        if offload.loads_layers:
            loaded.kv_cache.on_layer_needed = offload.wait_for_layer_load
    for kind, payload in read_messages(step_fd):
        if kind == RESET:
            batch.clear()
            continue
        if kind in KV_KINDS:
            if kv is None:
                raise ValueError("a KV transfer command for a both-role worker's rank")
            kv.handle(kind, json.loads(payload))
            continue
        if kind != STEP:
            raise ValueError(f"unknown message {kind!r} from rank 0")
        plan = plan_from_pb(worker_pb2.StepRequest.FromString(payload))
        try:
            work = batch.apply(plan.finished_ids, plan.new, plan.cached)
            if plan.moves:
                check_moves(plan.moves, loaded.kv_cache, loaded.swap_cache, loaded.offload_cache)
        except PlanError as exc:  # rank 0 refuses the same plan and reports it
            log.warning("bad_step_plan", step_id=plan.step_id, error=str(exc))
            continue
        run_swaps(plan.moves, loaded.kv_cache, loaded.swap_cache)
        if offload is not None:
            offload.start_load_kv(plan.moves, plan.step_id)
        run_copies(plan.moves, loaded.kv_cache)
        output = runner.execute(work)
        if offload is not None:
            offload.wait_for_save(plan.moves, plan.step_id)
            offload.get_finished()  # rank 0 reports; this rank's finished writes collected
        batch.complete(work, output.sampled, output.accepted_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.worker.parallel.peer")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--step-fd", type=int, required=True)
    parser.add_argument("--answer-fd", type=int, required=True)
    args, rest = parser.parse_known_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 drains, then closes the pipe
        signal.signal(sig, signal.SIG_IGN)
    config = load_config(WorkerConfig, rest, env={})
    setup_logging("worker", config.log_level)
    log = get_logger("services.worker.peer").bind(rank=args.rank)
    store = peer_store(args.store_port, config.world_size)
    num_layers = ModelConfig.from_folder(config.model).num_hidden_layers
    ranks = join_group(args.rank, config.layout, num_layers, store, config.device)
    loaded = load_worker(config, f"{config.resolved_worker_id}/rank{args.rank}", ranks)
    runner = ModelRunner(loaded.model, loaded.kv_cache, loaded.device, tokens=ranks.tokens)
    batch = PersistentBatch(
        loaded.kv_cache.block_size,
        loaded.kv_cache.num_blocks,
        loaded.model_config.vocab_size,
        loaded.kv_cache.num_groups,
    )
    kv = None  # a both-role worker never moves KV to another worker
    if config.role != "both":
        kv = RankKv.on_own_thread(
            args.rank,
            loaded.kv_cache.data,
            pool_axis_start(loaded, config.layout, ranks.stage.stage),
            args.answer_fd,
            TransferDeadline.from_config(config),
            config.kv_transfer_error_handling,
        )
    ranks.publish_pool(None if loaded.shared_pool is None else loaded.shared_pool.info)
    ranks.publish_ucx_address(b"" if kv is None else kv.address)
    freeze_startup_heap()
    log.info("rank_ready", num_blocks=loaded.kv_cache.num_blocks)
    try:
        serve_steps(args.step_fd, runner, batch, loaded, kv, log, ranks.all_min)
    finally:
        if kv is not None:
            kv.close()
        if loaded.disk_offload is not None:
            loaded.disk_offload.close()  # every file in flight written
    log.info("rank_stopping", reason="rank 0 closed the step pipe")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        pass
