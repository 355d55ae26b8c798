"""The operator actions' outcomes, without a database: the verdict per id from its state,
the sentence an operator reads for each verdict (pinned: the CLI and the dashboard print
them), and what ``Outcome`` derives from its verdicts."""

from __future__ import annotations

import uuid

import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.ops import operations
from fastapi_outbox.ops.operations import Action, IdOutcome, Outcome, Verdict, explain, verdict

MID = uuid.UUID("0190d6a8-0000-7000-8000-000000000001")


def test_actions_say_what_they_take() -> None:
    assert Action.REPLAY.takes == ("abandoned", "failed")
    assert Action.ABANDON.takes == ("pending", "failed")
    assert Action.CANCEL.takes == ("pending",)
    assert [a.done for a in Action] == ["replayed", "abandoned", "cancelled"]
    assert [a.unclaimed_only for a in Action] == [False, True, True]


@pytest.mark.parametrize(
    ("action", "state", "dry_run", "expected"),
    [
        (Action.REPLAY, None, False, IdOutcome(MID, Verdict.NOT_FOUND)),
        (
            Action.REPLAY,
            ("published", False),
            False,
            IdOutcome(MID, Verdict.WRONG_STATUS, "published"),
        ),
        # In a status it takes yet not changed: a relay took it meanwhile.
        (Action.REPLAY, ("failed", False), False, IdOutcome(MID, Verdict.HELD, "failed")),
        (Action.REPLAY, ("abandoned", False), True, IdOutcome(MID, Verdict.DONE)),
        # A replay takes failed messages whoever holds them; abandon and cancel do not.
        (Action.REPLAY, ("failed", True), True, IdOutcome(MID, Verdict.DONE)),
        (Action.ABANDON, ("failed", True), True, IdOutcome(MID, Verdict.HELD, "failed")),
        (Action.ABANDON, ("pending", False), True, IdOutcome(MID, Verdict.DONE)),
        (Action.CANCEL, ("pending", True), True, IdOutcome(MID, Verdict.HELD, "pending")),
        (Action.CANCEL, ("failed", False), True, IdOutcome(MID, Verdict.WRONG_STATUS, "failed")),
    ],
)
def test_verdict_from_the_state_of_an_id(
    action: Action, state: tuple[str, bool] | None, dry_run: bool, expected: IdOutcome
) -> None:
    assert verdict(action, MID, state, dry_run=dry_run) == expected


@pytest.mark.parametrize(
    ("action", "result", "text"),
    [
        (Action.REPLAY, IdOutcome(MID, Verdict.DONE), None),
        (Action.REPLAY, IdOutcome(MID, Verdict.NOT_FOUND), f"no outbox message with id {MID}"),
        (
            Action.REPLAY,
            IdOutcome(MID, Verdict.WRONG_STATUS, "pending"),
            f"message {MID} is pending: only abandoned or failed messages can be replayed",
        ),
        (
            Action.ABANDON,
            IdOutcome(MID, Verdict.HELD, "failed"),
            f"message {MID} is held by a relay right now: not abandoned",
        ),
        (
            Action.ABANDON,
            IdOutcome(MID, Verdict.WRONG_STATUS, "published"),
            f"message {MID} is published: only pending or failed messages can be abandoned",
        ),
        (Action.CANCEL, IdOutcome(MID, Verdict.NOT_FOUND), f"no outbox message with id {MID}"),
        (
            Action.CANCEL,
            IdOutcome(MID, Verdict.HELD, "pending"),
            f"too late: message {MID} is being published",
        ),
        (
            Action.CANCEL,
            IdOutcome(MID, Verdict.WRONG_STATUS, "published"),
            f"too late: message {MID} is published",
        ),
    ],
)
def test_each_verdict_reads_as_before(action: Action, result: IdOutcome, text: str | None) -> None:
    assert explain(action, result) == text


def test_outcome_derives_changed_and_problems_in_the_order_given() -> None:
    a, b, c = (uuid.UUID(int=i) for i in (1, 2, 3))
    outcome = Outcome(
        Action.REPLAY,
        [
            IdOutcome(a, Verdict.NOT_FOUND),
            IdOutcome(b, Verdict.DONE),
            IdOutcome(c, Verdict.WRONG_STATUS, "published"),
        ],
    )
    assert outcome.changed == [b] and outcome.count == 1
    assert [r.message_id for r in outcome.refused] == [a, c]
    assert outcome.problems == [
        f"no outbox message with id {a}",
        f"message {c} is published: only abandoned or failed messages can be replayed",
    ]


class _States:
    """A store that changes nothing and knows the states of a few ids."""

    def __init__(self, states: dict[uuid.UUID, tuple[str, bool]]) -> None:
        self._states = states

    async def cancel_unclaimed(self, ids: list[uuid.UUID]) -> list[uuid.UUID]:
        return []

    async def states(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, bool]]:
        return {i: self._states[i] for i in ids if i in self._states}


class _Store:
    def __init__(self, states: dict[uuid.UUID, tuple[str, bool]]) -> None:
        self.messages = _States(states)


class _Box:
    def __init__(self, states: dict[uuid.UUID, tuple[str, bool]]) -> None:
        self.store = _Store(states)


@pytest.mark.parametrize(
    ("states", "raised"),
    [({}, exceptions.MessageNotFound), ({MID: ("pending", True)}, exceptions.TooLate)],
)
async def test_cancel_one_raises_by_verdict(
    states: dict[uuid.UUID, tuple[str, bool]], raised: type[Exception]
) -> None:
    # Outbox.cancel: the exception follows the verdict, the message is the sentence.
    with pytest.raises(raised) as caught:
        await operations.cancel_one(_Box(states), MID)  # type: ignore[arg-type]
    assert str(caught.value) == explain(
        Action.CANCEL, verdict(Action.CANCEL, MID, states.get(MID), dry_run=False)
    )
