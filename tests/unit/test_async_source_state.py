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


class _DiesAfterSending:
    """A transport whose worker dies right after sending batch 0, its claim still naming it (``held``), as a process
    killed before its next claim (or blocked on the claim lock) leaves it."""

    n, ahead = 1, None

    def __init__(self):
        self.msgs, self.dead, self.restarted_on = [("batch", 0, 0, (None, {}))], False, []

    def start(self, first):
        pass

    def request(self, b, k):
        pass

    def poll(self, timeout_s):
        if not self.msgs:
            return None
        msg = self.msgs.pop(0)
        self.dead = msg[2] == 0 and not self.restarted_on
        return msg

    def held(self, wid):
        return 0

    def alive(self, wid):
        return not self.dead

    def busy_since(self, wid):
        return None

    def restart(self, wid, first):
        self.restarted_on.append(first)
        self.dead = False
        self.msgs += [("batch", 0, j, (None, {"made": j})) for j in ([0, 1] if first == 0 else [1])]
        return "killed"

    def close(self):
        pass


def test_a_worker_dead_after_sending_is_restarted_on_the_next_batch_not_the_one_trained_on():
    """It was restarted on batch 0 again, which it made a second time, and that copy stayed in the buffer for good
    (a leak and a wasted batch; a reviewer's fake transport). Now it starts the next unclaimed batch."""
    from trustbatch.pipeline.async_source import BoundedSource

    t = _DiesAfterSending()
    source = BoundedSource(t, max_staleness=1)
    source.next_batch(0)
    source.next_batch(1)
    assert t.restarted_on == [-1] and source.last_metrics["made"] == 1 and source.buffer == {}
