"""Reused staging buffers for KV transfers."""

from services.worker.parallel.kv_message_io import StagingBuffers


def test_buffers_are_reused_smallest_fitting_first_and_never_shared():
    pool = StagingBuffers(max_idle=2)
    a = pool.acquire(100)
    b = pool.acquire(50)
    assert a.nbytes == 100 and b.nbytes == 50 and pool.num_allocations == 2
    pool.release(a)
    pool.release(b)
    c = pool.acquire(40)  # the 50-byte buffer fits best
    assert c.nbytes == 40 and c.base is b.base and pool.num_allocations == 2
    d = pool.acquire(90)  # the 100-byte one
    assert d.base is a.base
    e = pool.acquire(10)  # nothing idle: a new one
    assert pool.num_allocations == 3 and e.base is not c.base
    for x in (c, d, e):
        pool.release(x)
    assert len(pool._idle) == 2  # only the largest two are kept
