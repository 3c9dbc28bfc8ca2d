"""diagnosis.position.current_stage: a rank's position from its beats."""

from __future__ import annotations

import numpy as np

from diagnosis.position import current_stage


def beats(rows: list[tuple[int, int, int, str, int]]) -> dict[str, np.ndarray]:
    rank, ts, step, stage, sts = zip(*rows, strict=True)
    return {"rank": np.array(rank), "ts": np.array(ts), "comm_id": np.full(len(rows), "w", object),
            "step": np.array(step), "stage": np.array(stage, dtype=object),
            "stage_ts": np.array(sts)}


def test_newest_beat_of_the_rank_wins() -> None:
    b = beats([(2, 100, 5, "model.fwd_loss", 90), (2, 200, 5, "model.backward", 150),
               (1, 300, 6, "optim.step", 280), (2, 150, 5, "model.fwd_loss", 90)])
    assert current_stage(b, 2) == (5, "model.backward", 150)
    assert current_stage(b, 1) == (6, "optim.step", 280)


def test_between_stages_and_unknown() -> None:
    b = beats([(0, 100, 3, "", 95), (1, 100, -1, "", 0), (1, 90, 2, "callbacks", 80)])
    assert current_stage(b, 0) == (3, "", 95)
    # rank 1's newest beat carries no position (an old producer): its last known one is used
    assert current_stage(b, 1) == (2, "callbacks", 80)
    assert current_stage(b, 7) is None
    assert current_stage(beats([(1, 100, -1, "", 0)]), 1) is None


def test_ties_on_ts_take_the_latest_entry() -> None:
    """One beat row per communicator, same ts: a position read between two rows may differ."""
    b = beats([(3, 100, 4, "model.fwd_loss", 70), (3, 100, 4, "model.backward", 95)])
    assert current_stage(b, 3) == (4, "model.backward", 95)


def test_old_beats_without_position_columns() -> None:
    assert current_stage({"rank": np.array([0]), "ts": np.array([1])}, 0) is None
    assert current_stage({}, 0) is None


def test_position_at_a_moment_reads_no_later_beat() -> None:
    """A stall that has ended is judged as of a moment inside it: where the rank was then."""
    b = beats([(0, 100, 7, "data.next_wait", 60), (0, 200, 7, "data.next_wait", 60),
               (0, 300, 7, "model.backward", 260)])
    assert current_stage(b, 0, 250) == (7, "data.next_wait", 60)
    assert current_stage(b, 0) == (7, "model.backward", 260)
    assert current_stage(b, 0, 50) is None
