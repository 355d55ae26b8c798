"""The one supervision loop (``lifecycle.supervisor.Supervisor``) on fake services: start in
order once ready, stop every stoppable service at once, await them within the shutdown
bound, cancel the rest."""

from __future__ import annotations

from typing import Any

import anyio

from fastapi_outbox.lifecycle.supervisor import StoppableService, Supervisor


class _Stoppable:
    def __init__(self, log: list[str], name: str, *, hangs: bool = False) -> None:
        self.log, self.name, self.hangs = log, name, hangs
        self.running = False
        self.stopped: anyio.Event | None = None
        self._stop = anyio.Event()

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        self._stop.set()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self.stopped = anyio.Event()
        self.running = True
        self.log.append(f"ready {self.name}")
        task_status.started()
        try:
            await self._stop.wait()
            if self.hangs:
                await anyio.sleep_forever()
            self.log.append(f"done {self.name}")
        finally:
            self.running = False
            self.stopped.set()


class _Forever:
    """Like the LISTEN listener: no stop, cancelled at the end."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            self.log.append("cancelled forever")


def test_only_services_with_stop_running_and_stopped_are_stoppable() -> None:
    assert isinstance(_Stoppable([], "a"), StoppableService)
    assert not isinstance(_Forever([]), StoppableService)


async def test_services_start_in_order_and_stop_together_before_the_rest_is_cancelled() -> None:
    log: list[str] = []
    a, b = _Stoppable(log, "a"), _Stoppable(log, "b")
    async with anyio.create_task_group() as tg:
        supervisor = Supervisor(tg, shutdown_timeout_seconds=60)
        for service in (a, _Forever(log), b):
            await supervisor.start(service)
        assert log == ["ready a", "ready b"]
        await supervisor.stop()
    assert log[2:4] == ["stop a", "stop b"]  # every stop asked before any wait
    assert set(log[4:6]) == {"done a", "done b"}
    assert log[6:] == ["cancelled forever"]
    assert not a.running and not b.running


async def test_a_service_that_does_not_stop_is_cancelled_after_the_bound() -> None:
    log: list[str] = []
    stuck, fine = _Stoppable(log, "stuck", hangs=True), _Stoppable(log, "fine")
    async with anyio.create_task_group() as tg:
        supervisor = Supervisor(tg, shutdown_timeout_seconds=0.05)
        await supervisor.start(stuck)
        await supervisor.start(fine)
        await supervisor.stop()
    assert "done fine" in log and "done stuck" not in log
    assert stuck.stopped is not None and stuck.stopped.is_set()  # cancelled, not left running
