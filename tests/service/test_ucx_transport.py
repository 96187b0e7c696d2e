"""A receive given up on (timed out, cancelled) is completed by the transport itself and its
buffer let go, instead of staying posted in UCX until a message that may never come.

The transport sends its own worker a 1-byte message with the abandoned tag; the real
message, sent late from another process (one UCX context per process), then finds no
receive and its sender times out, while later transfers between the two processes still
arrive intact. A send given up on is not touched: it stays held until it is received.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from services.worker.kv_transfer import KvTransferError, UcxTransport

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
NEVER_SENT, CANCELLED, AFTERWARDS = 0xB1, 0xB2, 0xB3


async def _released(transport: UcxTransport, within_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while transport.reap_abandoned():
        assert asyncio.get_running_loop().time() < deadline, "abandoned receive never released"
        await asyncio.sleep(0.01)
    assert transport.abandoned_bytes == 0


@pytest.mark.parametrize("error_handling", [True, False], ids=["tcp", "shm"])
def test_an_abandoned_receive_is_released_and_a_late_message_harms_nothing(error_handling):
    async def scenario() -> None:
        transport = UcxTransport(timeout_s=0.3, error_handling=error_handling)
        peer = None
        try:
            with pytest.raises(KvTransferError, match="receive"):
                await transport.receive(NEVER_SENT, MIB)
            await _released(transport)

            received = asyncio.ensure_future(transport.receive(CANCELLED, MIB))
            await asyncio.sleep(0.05)  # posted in UCX
            received.cancel()
            with pytest.raises(asyncio.CancelledError):
                await received
            await _released(transport)

            transport.timeout_s = 30.0  # the peer process takes a few seconds to start
            peer = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _peer; _peer()"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            hello = json.dumps({"address": transport.address.hex(), "eh": error_handling})
            peer.stdin.write(hello + "\n")
            peer.stdin.close()
            got = await transport.receive(AFTERWARDS, MIB)
            report = json.loads(await asyncio.to_thread(peer.stdout.readline))
            assert await asyncio.to_thread(peer.wait, 30) == 0
            assert report["late"].startswith("KvTransferError"), report  # nobody received it
            assert np.array_equal(got, np.arange(MIB, dtype=np.uint8))
            assert transport.reap_abandoned() == 0 and transport.abandoned_bytes == 0
        finally:
            if peer is not None and peer.poll() is None:
                peer.kill()
            await transport.close()

    asyncio.run(scenario())


def _peer() -> None:
    """Other process: sends the abandoned tag's real message late, then a normal transfer."""
    from common.log import setup_logging

    setup_logging("ucx-peer", "warning")  # logs to stderr; stdout carries the report
    hello = json.loads(sys.stdin.readline())
    address = bytes.fromhex(hello["address"])

    async def main() -> None:
        transport = UcxTransport(timeout_s=1.0, error_handling=hello["eh"])
        try:
            await transport.send("test", address, NEVER_SENT, np.full(MIB, 7, dtype=np.uint8))
            late = "sent"
        except KvTransferError as exc:
            late = repr(exc)
        transport.timeout_s = 30.0
        await transport.send("test", address, AFTERWARDS, np.arange(MIB, dtype=np.uint8))
        print(json.dumps({"late": late}), flush=True)
        await transport.close()

    asyncio.run(main())


def test_an_abandoned_send_without_peer_failure_handling_is_held_until_received():
    """Over shared memory (peer-failure handling off) aborting an endpoint cancels nothing:
    a send nobody receives yet keeps its buffer until a receive takes it."""

    async def scenario() -> None:
        transport = UcxTransport(timeout_s=0.3, error_handling=False)
        # Kept open: dropping the failed endpoint could otherwise strand the send.
        endpoint = await transport._endpoint(("self", transport.address))
        try:
            payload = np.full(MIB, 5, dtype=np.uint8)
            with pytest.raises(KvTransferError, match="send"):
                await transport.send("self", transport.address, 0xC1, payload)
            await asyncio.sleep(0.5)
            assert transport.reap_abandoned() == 1 and transport.abandoned_bytes == MIB
            got = await transport.receive(0xC1, MIB)
            assert np.array_equal(got, payload)
            await _released(transport)
        finally:
            await endpoint.close()
            await transport.close()

    asyncio.run(scenario())


def test_a_send_given_up_on_is_cancelled_with_its_endpoint_and_lets_go_of_its_buffer():
    """A send nobody receives (a peer behind a cut link, say) fails at its deadline; its
    endpoint is aborted, which cancels the send inside UCX, so its buffer is let go at
    once instead of being held until the link heals (or for ever). The next send to that
    peer makes a fresh endpoint and arrives whole."""

    async def scenario() -> None:
        transport = UcxTransport(timeout_s=0.3, error_handling=True)
        try:
            payload = np.full(MIB, 5, dtype=np.uint8)
            with pytest.raises(KvTransferError, match="send"):
                await transport.send("self", transport.address, 0xC1, payload)
            await _released(transport)
            transport.timeout_s = 5.0
            received = asyncio.ensure_future(transport.receive(0xC2, MIB))
            again = np.arange(MIB, dtype=np.uint8)
            await transport.send("self", transport.address, 0xC2, again)
            assert np.array_equal(await received, again)
        finally:
            await transport.close()

    asyncio.run(scenario())


def test_a_cancelled_send_nobody_receives_is_cancelled_at_its_deadline():
    """A send whose caller gives up early (the scheduler cancelled the transfer) and whose
    receiver never takes it (it dropped the receive) is not held for ever: at the send's
    deadline its endpoint is aborted, UCX cancels it, and the buffer is let go."""

    async def scenario() -> None:
        transport = UcxTransport(timeout_s=0.5, error_handling=True)
        try:
            payload = np.full(MIB, 3, dtype=np.uint8)
            send = asyncio.ensure_future(transport.send("self", transport.address, 0xE1, payload))
            await asyncio.sleep(0.1)
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
            assert transport.reap_abandoned() == 1  # held while its deadline runs
            await _released(transport, within_s=3.0)
        finally:
            await transport.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("error_handling", [True, False], ids=["tcp", "shm"])
def test_close_after_a_transfer_resets_ucx_for_the_next_transport(error_handling):
    """`close` shuts UCX down cleanly (no reference to its context left in any frame), so
    the next transport in the process starts on a fresh context and moves data."""

    async def transfer_then_close(tag: int) -> None:
        transport = UcxTransport(timeout_s=5.0, error_handling=error_handling)
        payload = np.arange(MIB, dtype=np.uint8)
        received = asyncio.ensure_future(transport.receive(tag, MIB))
        await transport.send("self", transport.address, tag, payload)
        assert np.array_equal(await received, payload)
        await transport.close()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(transfer_then_close(0xD1))
        asyncio.run(transfer_then_close(0xD2))  # another event loop: needs the reset
    failed = [e for e in logs if e["event"].startswith("ucx_") and e["log_level"] == "warning"]
    assert failed == []
