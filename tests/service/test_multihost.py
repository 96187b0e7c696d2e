"""P/D serving across hosts, and the network faults it must survive (issue 42).

One stack on four hosts of the namespace test bed (`services/stack/hosts.py`): the gateway
on host 0, the scheduler on host 1, the prefill worker and one decode worker ("near") on
host 2, the other decode worker ("far") alone on host 3. KV from the prefill worker to
"far" crosses hosts over UCX's TCP path; to "near" it is the same-host pull.

Each fault is made by the router between the hosts while requests of mixed lengths stream
(packets vanish: no RST, no ICMP error), measured, then healed. After each: every request
finished with exactly HF's greedy tokens (or, where the fault cut the client's own path,
ended UNAVAILABLE with HF's tokens so far), no block is held anywhere, every worker is back
in the scheduler's pools without a restart, and no process exited but the one killed.
Detection bounds (docs/reliability.md): gRPC keepalive 2 s + 4 s on every connection, the
UCX transfer deadline 5 s + bytes at 25 MB/s (a receive 10 s + ...).
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from common.pb.tandem.internal.v1 import worker_pb2, worker_pb2_grpc
from services.stack.hosts import Fabric
from services.stack.multihost import worker_names
from tests.fault_injection import assert_all_alive, wait_for, wait_healthy_pools
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.multihost import (
    kv_bytes,
    need_namespaces,
    offsets,
    start_on_hosts,
    ucx_held_bytes,
    wait_event,
)
from tests.stack_client import (
    BackgroundStream,
    frozen,
    generate,
    greedy_request,
    pool_stats,
    wait_until_idle,
    worker_active_requests,
)

GATEWAY, SCHEDULER, PREFILL, FAR = 0, 1, 2, 3
FILLER = " the blocks move between hosts over the network"  # ~9 prompt tokens
# Each test sends these under a word of its own, so none finds another's prompt in a
# decode worker's prefix cache (whose KV would then not cross any link). Every prompt is
# long enough (~100-200 tokens, 200-400 KB of KV) that a transfer of it outlasts the
# router's short queue on a capped link: a cut while KV is queued there hits a transfer.
PROMPTS = [
    "Once upon a time" + FILLER * 12,
    "The scheduler keeps every worker busy" + FILLER * 18,
    "KV blocks move between workers" + FILLER * 14,
    "In the beginning" + FILLER * 20,
    "Paged attention stores keys and values" + FILLER * 10,
    "Continuous batching" + FILLER * 16,
]
LENGTHS = [96, 24, 80, 16, 64, 40]  # mixed: some end during a fault, some after
# What a fault may take to be noticed here: keepalive (2 + 4 s) or a transfer deadline
# (5 s, a receive 10 s, at these sizes), plus a loaded box's slack.
DETECTION_BOUND_S = 15.0
HEALTH_FLAGS = ["--worker-health-interval-s", "0.5", "--worker-health-timeout-s", "1",
                "--worker-health-max-misses", "4"]  # fmt: skip
LONG = 300  # output tokens of the stream a gateway partition must cut off mid-way
LINK_COOL_DOWN_S = 3  # a prefill -> decode pair whose transfer failed is avoided this long


@pytest.fixture(scope="module")
def fabric():
    need_namespaces()
    with Fabric(4) as made:
        yield made


@pytest.fixture(scope="module")
def stack(fabric, tiny_llama_dir, tmp_path_factory):
    def placement(spec):
        (prefill,) = worker_names(spec, "prefill")
        far, near = worker_names(spec, "decode")
        return {"gateway": GATEWAY, "scheduler": SCHEDULER, prefill: PREFILL, near: PREFILL,
                far: FAR}  # fmt: skip

    scheduler = [*HEALTH_FLAGS, "--kv-link-cool-down-s", str(LINK_COOL_DOWN_S)]
    started = start_on_hosts(
        tiny_llama_dir, tmp_path_factory.mktemp("multihost"), fabric, placement,
        prefill=1, decode=2, extra_args={"scheduler": scheduler},
    )  # fmt: skip
    yield started
    started.stop()


@pytest.fixture(scope="module")
def names(stack):
    (prefill,) = worker_names(stack.spec, "prefill")
    far, near = worker_names(stack.spec, "decode")
    return prefill, far, near


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """HF's greedy ids of a prompt (`max(LENGTHS)` of them; shorter runs are prefixes)."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    cache: dict[str, list[int]] = {}

    def of(prompt: str, length: int = max(LENGTHS)) -> list[int]:
        key = f"{length}:{prompt}"
        if key not in cache:
            cache[key] = hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), length)
        return cache[key]

    return of


def prompts(salt: str) -> list[str]:
    return [f"{salt}: {p}" for p in PROMPTS]


def start_streams(stack, salt: str, timeout: float = 90.0) -> list[BackgroundStream]:
    return [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, n), timeout)
        for p, n in zip(prompts(salt), LENGTHS, strict=True)
    ]


def assert_exact(streams, reference, salt: str) -> None:
    for prompt, n, stream in zip(prompts(salt), LENGTHS, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (prompt, stream.code, stream.details)
        assert stream.token_ids == reference(prompt)[:n], prompt


def assert_whole_again(stack, reference) -> None:
    """Every worker back in the pools, nothing held anywhere, nobody dead, and a new
    request HF-exact."""
    wait_healthy_pools(stack, timeout_s=30)
    wait_until_idle(stack, timeout_s=30)
    assert_all_alive(stack)
    for worker in worker_names(stack.spec, "prefill") + worker_names(stack.spec, "decode"):
        # No UCX buffer stranded behind the fault (an aborted endpoint cancels its sends).
        wait_for(lambda w=worker: ucx_held_bytes(stack, w) == 0, 15, f"{worker} lets go")
    prompt = PROMPTS[0]
    assert (
        generate(stack.spec.gateway_address, greedy_request(prompt, 24)).token_ids
        == (reference(prompt)[:24])
    )


def streams_on(stack, worker: str, salt: str) -> list[tuple[str, list[BackgroundStream]]]:
    """Batches of streams (salt, streams), started until `worker` holds some of them:
    placement chooses the decode worker, so a batch may all land on the other one."""
    batches = []
    for attempt in range(6):
        batches.append((f"{salt}{attempt}", start_streams(stack, f"{salt}{attempt}")))
        try:
            wait_for(lambda: worker_active_requests(stack)[worker] > 0, 10, f"work on {worker}")
            return batches
        except AssertionError:
            continue
    raise AssertionError(f"no request placed on {worker}; pools: {pool_stats(stack).pools}")


def assert_batches_exact(batches, reference) -> None:
    for salt, streams in batches:
        assert_exact(streams, reference, salt)


def host_id(stack, worker: str) -> str:
    with grpc.insecure_channel(stack.process(worker).address) as channel:
        described = worker_pb2_grpc.WorkerServiceStub(channel).DescribeWorker(
            worker_pb2.DescribeWorkerRequest(), timeout=10
        )
    return described.kv_shared_memory.host_id


def test_services_run_on_their_hosts_and_kv_crosses_hosts_over_ucx(stack, fabric, names, reference):
    prefill, far, near = names
    for name, host in (("gateway", GATEWAY), ("scheduler", SCHEDULER), (prefill, PREFILL),
                       (near, PREFILL), (far, FAR)):  # fmt: skip
        assert stack.process(name).address.split(":")[0] == fabric.hosts[host].address
    # Host identity is per namespace: only the pair sharing host 2 may use shared memory.
    assert host_id(stack, prefill) == host_id(stack, near) != host_id(stack, far)

    streams = start_streams(stack, "hosts")
    assert_exact(streams, reference, "hosts")
    assert kv_bytes(stack, far, "receive") > 0  # over UCX, across hosts
    assert kv_bytes(stack, far, "pull") == 0  # never the same-host pull across hosts
    assert kv_bytes(stack, near, "pull") > 0  # the same-host pull inside one namespace
    assert_whole_again(stack, reference)


def test_a_p_to_d_link_cut_mid_transfer_is_noticed_and_its_requests_go_elsewhere(
    stack, fabric, names, reference
):
    prefill, far, near = names
    before = pool_stats(stack)
    marks = offsets(stack)
    fabric.cap(FAR, 1)  # 125 KB/s: a prompt's KV takes seconds to cross
    try:
        streams = start_streams(stack, "cut")
        # Forced, not hoped for: the cut comes while KV is queued on the link.
        wait_for(lambda: fabric.backlog_bytes(FAR) > 16384, 60, "KV in flight to far")
        fabric.block(PREFILL, FAR)
        cut = time.monotonic()
        _, seen = wait_event(stack, marks["scheduler"], "kv_link_avoided", src=prefill, dst=far)
        assert seen - cut < DETECTION_BOUND_S
        print(f"P->D cut noticed after {seen - cut:.1f} s")
        assert_exact(streams, reference, "cut")  # recomputed, handed to `near`
    finally:
        fabric.unblock(PREFILL, FAR)
        fabric.uncap(FAR)
    after = pool_stats(stack)
    assert after.worker_failures == before.worker_failures  # both ends were alive
    assert after.restarted_requests > before.restarted_requests
    assert_whole_again(stack, reference)
    # After its cool-down the healed link carries KV again.
    received = kv_bytes(stack, far, "receive")
    for attempt in range(20):
        salt = f"back{attempt}"
        assert_exact(start_streams(stack, salt), reference, salt)
        if kv_bytes(stack, far, "receive") > received:
            break
    else:
        raise AssertionError("no KV crossed to far after the heal")


def test_a_partition_between_scheduler_and_decode_worker_fails_it_fast_and_it_frees_all(
    stack, fabric, names, reference
):
    _, far, _ = names
    partition_far_from_scheduler(stack, fabric, far, reference, both_ways=True, salt="split")


def test_a_half_open_connection_to_a_decode_worker_is_noticed_like_a_partition(
    stack, fabric, names, reference
):
    """Only the scheduler's packets to the worker vanish; the worker's still arrive."""
    _, far, _ = names
    partition_far_from_scheduler(stack, fabric, far, reference, both_ways=False, salt="half")


def partition_far_from_scheduler(stack, fabric, far, reference, both_ways: bool, salt: str):
    before = pool_stats(stack)
    marks = offsets(stack)
    batches = streams_on(stack, far, salt)
    fabric.block(SCHEDULER, FAR, both_ways=both_ways)
    cut = time.monotonic()
    try:
        _, failed = wait_event(stack, marks["scheduler"], "worker_failed", worker_id=far)
        # The worker, still computing, notices too and lets go of everything it held.
        wait_for(lambda: worker_active_requests(stack)[far] == 0, 30, f"{far} freed")
        freed = time.monotonic()
        assert max(failed, freed) - cut < DETECTION_BOUND_S
        print(f"partition noticed: scheduler {failed - cut:.1f} s, worker {freed - cut:.1f} s")
        assert_batches_exact(batches, reference)  # recomputed on the other decode worker
    finally:
        fabric.unblock(SCHEDULER, FAR, both_ways=both_ways)
    healed = time.monotonic()
    _, back = wait_event(stack, marks["scheduler"], "worker_rejoined", worker_id=far)
    print(f"rejoined {back - healed:.1f} s after the heal")
    assert back - healed < DETECTION_BOUND_S
    after = pool_stats(stack)
    assert after.worker_failures == before.worker_failures + 1
    assert_whole_again(stack, reference)


def test_a_partition_between_gateway_and_scheduler_ends_streams_cleanly(stack, fabric, reference):
    marks = offsets(stack)
    streams = start_streams(stack, "gateway")
    # One stream far longer than the rest: still running when the cut comes, for certain.
    long_prompt = prompts("gateway")[4]
    long = BackgroundStream(stack.spec.gateway_address, greedy_request(long_prompt, LONG), 90)
    for stream in [*streams, long]:
        stream.wait_tokens(2)
    with frozen(stack, worker_names(stack.spec, "decode")):  # nothing ends while it is made
        fabric.block(GATEWAY, SCHEDULER)
    assert long.code is None
    cut = time.monotonic()
    try:
        long.result()
        assert long.code == grpc.StatusCode.UNAVAILABLE, (long.code, long.details)
        assert 2 <= len(long.token_ids) < LONG
        assert long.token_ids == reference(long_prompt, LONG)[: len(long.token_ids)]
        for prompt, n, stream in zip(prompts("gateway"), LENGTHS, streams, strict=True):
            stream.result()
            # Streams that had begun cannot move to another scheduler: they end cleanly.
            assert stream.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), (
                stream.code, stream.details)  # fmt: skip
            assert stream.token_ids == reference(prompt)[: len(stream.token_ids)]
            if stream.code == grpc.StatusCode.OK:
                assert len(stream.token_ids) == len(reference(prompt)[:n])
            assert stream.ended_at - cut < DETECTION_BOUND_S
        # The scheduler noticed its gateway gone and freed what its requests held.
        wait_event(stack, marks["scheduler"], "session_ended", timeout_s=DETECTION_BOUND_S)
        wait_until_idle(stack, timeout_s=DETECTION_BOUND_S)
    finally:
        fabric.unblock(GATEWAY, SCHEDULER)
    healed = time.monotonic()
    served = wait_for(lambda: _served(stack, reference), 30, "served after the heal", 0.2)
    print(f"gateway served again {time.monotonic() - healed:.1f} s after the heal")
    assert served
    assert_whole_again(stack, reference)


def _served(stack, reference) -> bool:
    try:
        out = generate(stack.spec.gateway_address, greedy_request(PROMPTS[1], 8), timeout=5)
    except grpc.RpcError:
        return False
    return out.token_ids == reference(PROMPTS[1])[:8]


def test_a_slow_kv_link_slows_transfers_but_fails_nothing(stack, fabric, names, reference):
    _, far, _ = names
    before = pool_stats(stack)
    received = kv_bytes(stack, far, "receive")
    fabric.cap(FAR, 8)  # 1 MB/s into and out of far's host
    try:
        streams = start_streams(stack, "slow")
        assert_exact(streams, reference, "slow")
    finally:
        fabric.uncap(FAR)
    after = pool_stats(stack)
    assert kv_bytes(stack, far, "receive") > received  # KV did cross the slow link
    assert after.worker_failures == before.worker_failures
    assert after.restarted_requests == before.restarted_requests
    assert_whole_again(stack, reference)


def test_a_decode_hosts_reboot_moves_its_requests_and_it_rejoins_empty(
    stack, fabric, names, reference
):
    _, far, _ = names
    marks = offsets(stack)
    batches = streams_on(stack, far, "reboot")
    fabric.link_down(FAR)  # the host vanishes: its processes die with no FIN or RST out
    cut = time.monotonic()
    stack.signal(far, signal.SIGKILL)
    stack.wait_exit(far)
    _, failed = wait_event(stack, marks["scheduler"], "worker_failed", worker_id=far)
    assert failed - cut < DETECTION_BOUND_S
    print(f"reboot noticed after {failed - cut:.1f} s")
    assert_batches_exact(batches, reference)
    fabric.link_up(FAR)  # back with the same address and an empty pool
    stack.restart(far)
    wait_event(stack, marks["scheduler"], "worker_rejoined", worker_id=far)
    assert_whole_again(stack, reference)
