"""A resumed async source continues the run's counts of dropped batches and worker restarts (they restarted at 0,
so the logged batches_dropped_stale and worker_restarts undercounted a resumed run)."""

from trustbatch.pipeline.async_source import BoundedSource


class _Transport:
    n, ahead = 1, None  # latest order: no weight snapshots in the state


def test_the_counts_survive_a_state_round_trip():
    source = BoundedSource(_Transport(), max_staleness=2)
    source.batch_index, source.dropped, source.restarts = 7, 3, 2
    resumed = BoundedSource(_Transport(), max_staleness=2)
    resumed.load_state_dict(source.state_dict())
    assert (resumed.batch_index, resumed.dropped, resumed.restarts) == (7, 3, 2)
    old = {"batch_index": 5, "max_staleness": 2}  # a checkpoint written before the counts were kept
    resumed.load_state_dict(old)
    assert (resumed.batch_index, resumed.dropped, resumed.restarts) == (5, 0, 0)
