"""The wake-up policy on fake relays: before the commit, whether its COMMIT carries a NOTIFY
(``relay.wakeups.notify_with_commit``); after it (``relay.wakeups.wake_after_commit``), who
is woken, who is scheduled, and when the committer must still send a NOTIFY."""

from __future__ import annotations

import anyio
import anyio.abc

from fastapi_outbox.relay.wakeups import Wakeup, notify_with_commit, wake_after_commit


class _Relay:
    def __init__(self, *, stopping: bool = False) -> None:
        self.wakeup = Wakeup()
        self.stopping = stopping
        self.scheduled: list[float] = []

    def schedule(self, delay_seconds: float) -> None:
        self.scheduled.append(delay_seconds)


class _WalRelay:
    def __init__(self, *, leader: bool) -> None:
        self.wakeup = Wakeup()
        self.leader = leader
        self.stopping = False


class _Notifier:
    def __init__(self) -> None:
        self.running = True
        self.signals = 0

    def signal(self) -> None:
        self.signals += 1


async def _idle(relay: _Relay, tg: anyio.abc.TaskGroup, woken: list[bool]) -> None:
    async def worker() -> None:
        woken.append(await relay.wakeup.wait(None))

    tg.start_soon(worker)
    await anyio.wait_all_tasks_blocked()
    assert relay.wakeup.idle_waiters == 1


def test_nothing_written_wakes_nobody() -> None:
    assert wake_after_commit({}, {}, None, None, can_notify=True) is False


async def test_an_idle_worker_here_takes_rows_due_now_and_no_notify_is_needed() -> None:
    relay, woken = _Relay(), []
    async with anyio.create_task_group() as tg:
        await _idle(relay, tg, woken)
        assert (
            wake_after_commit({"default": 0.0}, {"default": relay}, None, None, can_notify=True)
            is False
        )
    assert woken == [True]


def test_no_idle_worker_here_asks_for_a_notify_when_one_can_be_sent() -> None:
    relay = _Relay()
    assert wake_after_commit({"default": 0.0}, {"default": relay}, None, None, can_notify=True)
    assert not wake_after_commit({"default": 0.0}, {"default": relay}, None, None, can_notify=False)


def test_a_running_notifier_sends_it_instead_of_the_committer() -> None:
    notifier = _Notifier()
    assert not wake_after_commit({"default": 0.0}, {}, None, notifier, can_notify=True)  # type: ignore[arg-type]
    assert notifier.signals == 1


def test_delayed_rows_schedule_the_poller_and_other_processes_are_told() -> None:
    relay = _Relay()
    assert wake_after_commit({"default": 5.0}, {"default": relay}, None, None, can_notify=True)
    assert relay.scheduled == [5.0]


def test_a_stopping_or_unknown_relay_leaves_it_to_other_processes() -> None:
    stopping = _Relay(stopping=True)
    assert wake_after_commit({"default": 0.0}, {"default": stopping}, None, None, can_notify=True)
    assert wake_after_commit({"other": 0.0}, {"default": _Relay()}, None, None, can_notify=True)


def test_wal_capture_wakes_the_wal_relay_and_only_a_leader_here_suffices() -> None:
    leader = _WalRelay(leader=True)
    assert not wake_after_commit({"default": 0.0}, {}, leader, None, can_notify=True)
    standby = _WalRelay(leader=False)
    assert wake_after_commit({"default": 0.0}, {}, standby, None, can_notify=True)
    # Delayed rows are table rows, for the relays, even with capture="wal".
    relay = _Relay()
    wake_after_commit({"default": 2.0}, {"default": relay}, leader, None, can_notify=True)
    assert relay.scheduled == [2.0]


async def test_the_commit_carries_a_notify_unless_an_idle_worker_here_takes_the_rows() -> None:
    relay, woken = _Relay(), []
    here = {"default": relay}
    # No worker of this process waits: other processes must be told.
    assert notify_with_commit({"default": 0.0}, here, None, can_notify=True) is True
    async with anyio.create_task_group() as tg:
        await _idle(relay, tg, woken)
        assert notify_with_commit({"default": 0.0}, here, None, can_notify=True) is False
        # Delayed rows, another broker's rows: other processes are told all the same.
        assert notify_with_commit({"default": 5.0}, here, None, can_notify=True) is True
        assert notify_with_commit({"audit": 0.0}, here, None, can_notify=True) is True
        assert notify_with_commit({"audit": 0.0}, here, None, can_notify=False) is False
        # The COMMIT carried it: after the commit only this process's worker is woken.
        notifier = _Notifier()
        assert (
            wake_after_commit(
                {"default": 0.0, "audit": 0.0},
                here,
                None,
                notifier,  # type: ignore[arg-type]
                can_notify=True,
                notified=True,
            )
            is False
        )
        assert notifier.signals == 0
    assert woken == [True]
    assert notify_with_commit({}, here, None, can_notify=True) is False
    assert (
        notify_with_commit({"default": 0.0}, {}, _WalRelay(leader=True), can_notify=True) is False
    )
    assert (
        notify_with_commit({"default": 0.0}, {}, _WalRelay(leader=False), can_notify=True) is True
    )
