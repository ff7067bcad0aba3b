"""The shared-memory bucket pool (megarl/rollout/bucket_pool.py): a version's buffers come back only when every
holder has let go, and a later lease of the same sizes gets those buffers instead of new ones."""
from megarl.rollout.bucket_pool import DISK, SENDER, SharedBucketPool


def test_buffers_come_back_when_every_holder_let_go():
    pool = SharedBucketPool()
    v1 = pool.lease()
    a, b = v1.alloc(64), v1.alloc(32)
    assert a.is_shared() and a.numel() == 64 and pool.n_allocated == 2 and pool.bytes_allocated == 96
    v1.release(SENDER)  # the disk copy still reads them
    v2 = pool.lease()
    c = v2.alloc(64)
    assert c.data_ptr() != a.data_ptr() and pool.n_allocated == 3 and pool.free_bytes() == 0
    v1.release(DISK)
    assert pool.free_bytes() == 96
    v3 = pool.lease((SENDER,))  # a lease of the sender alone (buckets cut per worker)
    assert {v3.alloc(32).data_ptr(), v3.alloc(64).data_ptr()} == {b.data_ptr(), a.data_ptr()}
    assert pool.n_reused == 2 and pool.n_allocated == 3 and v3.alloc(32).data_ptr() not in (a.data_ptr(), b.data_ptr())
    v3.release(SENDER)
    assert pool.free_bytes() == 128  # 64 + 32 + 32
    v3.release(SENDER)  # a second release gives nothing back twice
    assert pool.free_bytes() == 128
    pool.clear()
    assert pool.free_bytes() == 0
