"""The assignment logic of ordered subscribers across processes
(:mod:`fastapi_outbox.consume.partitioned`): the partition of a key, the fair share, and a
rebalance that converges when processes join, leave or die."""

from __future__ import annotations

import random

import pytest

from fastapi_outbox.consume.partitioned import fair_share, partition_of, rebalance


def test_a_key_has_one_partition_in_every_process_and_release() -> None:
    # CRC-32: fixed by its definition, not by the process's hash seed.
    assert partition_of("order-42", "m1", 16) == partition_of("order-42", "m2", 16)
    import zlib

    assert partition_of("order-42", "ignored", 16) == zlib.crc32(b"order-42") % 16
    # Without a key, the message id decides (keyless messages spread, in no order).
    assert partition_of(None, "m1", 16) == zlib.crc32(b"m1") % 16
    spread = {partition_of(f"key-{k}", "", 16) for k in range(200)}
    assert spread == set(range(16))


@pytest.mark.parametrize(
    ("partitions", "members", "share"),
    [(16, 1, 16), (16, 3, 6), (16, 4, 4), (16, 17, 1), (12, 5, 3), (1, 3, 1), (16, 0, 16)],
)
def test_fair_share_is_the_ceiling(partitions: int, members: int, share: int) -> None:
    assert fair_share(partitions, members) == share


def test_rebalance_gives_up_the_excess_and_takes_up_to_the_share() -> None:
    assert rebalance(owned=12, partitions=12, members=3) == (8, 0)
    assert rebalance(owned=0, partitions=12, members=3) == (0, 4)
    assert rebalance(owned=4, partitions=12, members=3) == (0, 0)
    assert rebalance(owned=3, partitions=12, members=5) == (0, 0)


def _settle(owners: dict[int, str | None], members: list[str], rounds: int) -> None:
    """Each member in turn applies rebalance against the shared table: releases its
    highest partitions, takes free ones (the coordinator's steps)."""
    rng = random.Random(7)
    for _ in range(rounds):
        for m in rng.sample(members, len(members)):
            mine = sorted(p for p, o in owners.items() if o == m)
            give, take = rebalance(len(mine), len(owners), len(members))
            for p in mine[len(mine) - give :]:
                owners[p] = None
            for p in [p for p, o in owners.items() if o is None][:take]:
                owners[p] = m


def _check(owners: dict[int, str | None], members: list[str]) -> None:
    assert all(o in members for o in owners.values())  # every partition owned, by a live one
    share = fair_share(len(owners), len(members))
    counts = [sum(1 for o in owners.values() if o == m) for m in members]
    assert max(counts) <= share


def test_rebalance_converges_as_processes_join_leave_and_die() -> None:
    owners: dict[int, str | None] = dict.fromkeys(range(16))
    members = ["a"]
    _settle(owners, members, 2)
    assert set(owners.values()) == {"a"}
    members += ["b", "c"]  # two join
    _settle(owners, members, 3)
    _check(owners, members)
    assert {o for o in owners.values()} == {"a", "b", "c"}
    members.remove("b")  # b dies: its leases expire, its partitions are free
    for p, o in owners.items():
        if o == "b":
            owners[p] = None
    _settle(owners, members, 3)
    _check(owners, members)
    members += ["d", "e", "f", "g"]
    _settle(owners, members, 4)
    _check(owners, members)
