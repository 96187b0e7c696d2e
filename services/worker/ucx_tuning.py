"""UCX defaults for KV transfers, set in the environment before UCX loads (imported at the
top of `kv_transfer`). Each is an `os.environ.setdefault`: a value the user sets wins.

`UCX_TCP_RX_SEG_SIZE=512K` (UCX 1.21's default: 64K). With peer-failure handling on (the
default), a transfer between hosts goes over UCX's `tcp` transport, which gives UCP no
remote memory access (`UCX_PROTO_INFO=y` shows `ucp_put*` as "software emulation"). A
message from 8 KiB up is a rendezvous whose data travels as active-message fragments of at
most the receiver's receive segment: 64 KiB by default, 1024 fragments for 64 MiB, each
read into a UCX segment, copied into the receive buffer, and paid for with a progress and
epoll round. Measured between two network namespaces of `services.stack.hosts.Fabric` (2
vCPU EPYC VM, `ucx_perftest -t tag_lat -e -E sleep`, one-way latency, repeated runs):

    segment    64K (default)  128K     256K    512K     768K    1M
    64 MiB     22-35 ms       13-17    12.2    11-13.6  11-11.2 15-19
    16 MiB     5.9-7.2 ms     3.8-9.2  3.0-5.8 2.8-3.4  2.8-2.9
    1 MiB      0.29-0.35 ms   unchanged within noise

512K is the smallest segment at the plateau; larger ones bought nothing (1M was slower,
probably as the segment no longer stays in this CPU's 1 MiB L2). Through Tandem's own path
(`python -m bench.kv_cross_host`: `UcxTransport` over ucxx, same namespaces) a 64 MiB
message went from 24-42 ms to 12-19 ms (a plain Python TCP stream: 21-28 ms), and the
whole KV hand-off (gather, message, scatter) from 62-67 ms to 45-49 ms. The rendezvous
threshold stays where it was (8 KiB), so a message whose receive was given up on still
finds no receive and its sender times out (the contract `kv_transfer` relies on). Cost:
UCX's receive buffer pool grows 8 segments at a time (UCX_TCP_RX_BUFS_GROW), 4 MiB instead
of 512 KiB per worker. Same-host transfers do not change: over shared memory (error
handling off) they never use it, and `bench.kv_transfer`'s same-host `ucx_tcp` path measured
the same with and without it.

Measured and left at UCX's defaults (no change beyond noise, or a change for the worse):
`UCX_TCP_SNDBUF`/`UCX_TCP_RCVBUF` (4M), `UCX_TCP_TX_SEG_SIZE` (64K: only eager messages up
to 8 KiB use it), `UCX_TCP_MAX_POLL` (64), `UCX_MAX_RNDV_RAILS` (1, 4: one device, one
lane), `UCX_RNDV_SCHEME` (get_zcopy, am: tcp has no RMA, `am` is what `auto` picks).
`UCX_RNDV_THRESH` was not raised: an eager message completes at its sender without a
matching receive, which would break the abandoned-receive contract above (and hold the
bytes in the receiver's unexpected queue). The 100 ms epoll wakeup of the progress thread
(`kv_transfer.QUIET_EPOLL_TIMEOUT_MS`) adds no latency here: TCP traffic wakes the thread
through its event fd (1 ms measured the same).
"""

from __future__ import annotations

import os

# name -> value, applied unless already set in the environment
SETTINGS: dict[str, str] = {
    "UCX_TCP_RX_SEG_SIZE": "512K",
}

for _name, _value in SETTINGS.items():
    os.environ.setdefault(_name, _value)
