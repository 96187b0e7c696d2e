"""On a CUDA machine: KV over UCX stays in device memory. Staging buffers of a GPU pool are
device tensors, reused; UCX moves device memory between two processes (into a device
buffer, bytes intact) with and without peer-failure handling; a receive given up on is
completed by the transport's 1-byte self-send even into device memory. The workers'
gather → send → receive → scatter over it runs in test_e2e_gpu.py (a CUDA pool is not
shared, so that stack moves KV this way). Skips without a GPU."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.worker.kv_transfer import KvTransferError, UcxTransport
from services.worker.parallel.kv_message_io import StagingBuffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 8 << 20
TAG, ABANDONED = 0xD1, 0xD2


def pattern(nbytes: int, device) -> torch.Tensor:
    return (torch.arange(nbytes, device=device, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def test_a_gpu_pool_stages_in_reused_device_buffers():
    staging = StagingBuffers(device=torch.device("cuda"))
    a = staging.acquire(1000)
    assert a.is_cuda and a.dtype == torch.uint8 and a.nbytes == 1000
    staging.release(a)
    b = staging.acquire(600)
    assert b.data_ptr() == a.data_ptr() and staging.num_allocations == 1


@pytest.mark.parametrize("error_handling", [True, False], ids=["peer-failure-handling", "shm"])
def test_ucx_moves_device_memory_between_processes(error_handling):
    async def scenario() -> None:
        torch.cuda.set_device(0)  # the CUDA context first: UCX's CUDA transports need it
        transport = UcxTransport(timeout_s=0.3, error_handling=error_handling)
        peer = None
        try:
            abandoned = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
            with pytest.raises(KvTransferError, match="receive"):
                await transport.receive(ABANDONED, NBYTES, out=abandoned)
            assert transport.reap_abandoned() == 0  # completed by the self-send
            transport.timeout_s = 60.0
            peer = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _peer; _peer()"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                text=True,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
                    ),
                },
            )
            peer.stdin.write(json.dumps({"address": transport.address.hex(), "eh": error_handling}))
            peer.stdin.close()
            out = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
            got = await transport.receive(TAG, NBYTES, out=out)
            assert got is out
            assert torch.equal(out, pattern(NBYTES, "cuda"))
            assert await asyncio.to_thread(peer.wait, 60) == 0
        finally:
            if peer is not None and peer.poll() is None:
                peer.kill()
            await transport.close()

    asyncio.run(scenario())


def _peer() -> None:
    hello = json.loads(sys.stdin.readline())

    async def main() -> None:
        torch.cuda.set_device(0)
        transport = UcxTransport(timeout_s=60.0, error_handling=hello["eh"])
        payload = pattern(NBYTES, "cuda")
        torch.cuda.synchronize()
        await transport.send("test", bytes.fromhex(hello["address"]), TAG, payload)
        await transport.close()

    asyncio.run(main())
