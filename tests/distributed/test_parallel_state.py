"""The tensor-parallel group: a single rank never touches torch.distributed; two gloo ranks
run real collectives (the `_on_rank` functions run in the spawned ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from serve.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
)


def test_without_init_this_process_is_rank_0_of_1():
    tp = get_tp_group()
    assert (tp.rank, tp.world_size, tp.is_driver) == (0, 1, True)
    x = torch.randn(3, 4)
    for out in (tp.all_reduce(x), tp.all_gather(x), tp.gather(x), tp.broadcast(x)):
        assert out is x
    assert not dist.is_initialized()


def test_a_world_of_one_opens_no_process_group():
    init_tensor_parallel(1, 0, None, "gloo")
    try:
        assert get_tp_group().world_size == 1
        assert not dist.is_initialized()
        with pytest.raises(RuntimeError, match="already initialised"):
            init_tensor_parallel(1, 0, None, "gloo")
    finally:
        destroy_tensor_parallel()
    destroy_tensor_parallel()  # idempotent
    assert get_tp_group().world_size == 1


@pytest.mark.parametrize(
    "world_size, rank, init_method, backend, message",
    [
        (2, 2, "tcp://127.0.0.1:1", "gloo", "rank 2 is not in a tensor-parallel group of 2"),
        (0, 0, None, "gloo", "group of 0"),
        (2, 0, "tcp://127.0.0.1:1", "mpi", "backend must be one of gloo, nccl"),
        (2, 0, None, "gloo", "need an init_method"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    world_size, rank, init_method, backend, message
):
    with pytest.raises(ValueError, match=message):
        init_tensor_parallel(world_size, rank, init_method, backend)
    assert get_tp_group().world_size == 1


def _collectives_on_rank(seed: int) -> dict:
    tp = get_tp_group()
    torch.manual_seed(seed + tp.rank)  # every rank's own input
    x = torch.randn(3, 4)
    return {
        "rank": (tp.rank, tp.world_size, tp.is_driver),
        "x": x.clone(),
        "all_reduce": tp.all_reduce(x.clone()),
        "all_gather_last": tp.all_gather(x),
        "all_gather_0": tp.all_gather(x, dim=0),
        "gather_0": tp.gather(x, dim=-1, dst=0),
        "gather_1": tp.gather(x, dim=0, dst=1),
        "broadcast_1": tp.broadcast(x.clone(), src=1),
    }


def test_collectives_over_two_ranks(tp2_ranks):
    r0, r1 = tp2_ranks.run(_collectives_on_rank, 7)
    assert r0["rank"] == (0, 2, True) and r1["rank"] == (1, 2, False)
    x0, x1 = r0["x"], r1["x"]
    assert not torch.equal(x0, x1)
    for r in (r0, r1):
        torch.testing.assert_close(r["all_reduce"], x0 + x1)
        assert torch.equal(r["all_gather_last"], torch.cat([x0, x1], dim=-1))
        assert torch.equal(r["all_gather_0"], torch.cat([x0, x1], dim=0))
        assert torch.equal(r["broadcast_1"], x1)
    assert torch.equal(r0["gather_0"], torch.cat([x0, x1], dim=-1)) and r1["gather_0"] is None
    assert r0["gather_1"] is None and torch.equal(r1["gather_1"], torch.cat([x0, x1], dim=0))


def _raise_on_rank_1() -> None:
    if get_tp_group().rank == 1:
        raise RuntimeError("boom on rank 1")


def test_a_failing_rank_fails_the_test_with_its_traceback(tp2_ranks):
    from rank_pool import RankError

    with pytest.raises(RankError, match=r"(?s)rank 1:.*boom on rank 1"):
        tp2_ranks.run(_raise_on_rank_1)
    assert [g.rank for g in tp2_ranks.run(get_tp_group)] == [0, 1]  # the pool still serves
