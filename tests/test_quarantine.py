"""Quarantine decisions (pure): faults count at once, layout disputes by votes per epoch."""

from moshray.cluster.coordinator.quarantine import Quarantine


def test_a_fault_counts_at_once_once_per_receiver_and_round():
    q = Quarantine(threshold=2)
    assert q.note("a", "c", "non_finite", 1, 0.0) is None
    assert q.note("a", "c", "non_finite", 1, 0.1) is None  # same receiver and round
    assert q.note("b", "c", "late", 1, 0.2) is None  # not the sender's fault
    record = q.note("b", "c", "non_finite", 1, 0.3)
    assert record is not None and (record.peer_id, record.reason) == ("c", "non_finite")


def test_a_wrong_shape_peer_among_three_is_quarantined_and_its_accusations_do_not_count():
    q = Quarantine(threshold=3)
    made = []
    for epoch in (1, 2):
        # c sends one value too many: a and b reject c, and c rejects both of them
        for reporter, sender in (("c", "a"), ("a", "c"), ("c", "b"), ("b", "c")):
            assert q.note(reporter, sender, "shape_mismatch", epoch, float(epoch)) is None
        assert q.settle(epoch, float(epoch)) == []  # the epoch is not over yet
        made += q.settle(epoch + 1, epoch + 0.5)
    assert [(r.peer_id, r.reason) for r in made] == [("c", "shape_mismatch")]
    assert q.settle(10, 3.0) == []  # its votes are spent: nobody else, and c not twice


def test_a_one_to_one_dispute_counts_for_nobody():
    q = Quarantine(threshold=1)
    q.note("a", "b", "shape_mismatch", 1, 0.0)
    q.note("b", "a", "shape_mismatch", 1, 0.0)
    assert q.settle(5, 1.0) == [] and q.records == []


def test_a_late_report_of_a_settled_epoch_is_added_to_its_votes():
    q = Quarantine(threshold=1)
    q.note("c", "a", "shape_mismatch", 1, 0.0)  # the broken peer's report came first ...
    q.note("a", "c", "shape_mismatch", 1, 0.0)
    assert q.settle(2, 0.5) == []  # ... a tie so far: nobody counts
    q.note("b", "c", "shape_mismatch", 1, 1.0)  # b's report was late
    assert [r.peer_id for r in q.settle(2, 1.5)] == ["c"]


def test_votes_expire_with_the_window_and_a_quarantine_starts_a_clean_record():
    q = Quarantine(threshold=2, window_s=10.0)
    q.note("a", "c", "dtype_mismatch", 1, 0.0)
    assert q.settle(2, 20.0) == [] and q._votes == {}  # expired before it was settled
    q.note("a", "c", "non_finite", 3, 21.0)
    assert q.note("b", "c", "non_finite", 4, 22.0) is not None
    assert q.note("a", "c", "non_finite", 5, 23.0) is None  # one count again, not three


def test_a_one_to_one_length_dispute_is_settled_by_the_swarms_layout():
    q = Quarantine(threshold=2)
    for epoch in (1, 2):
        q.note("a", "c", "shape_mismatch", epoch, 0.0, numel=101)  # c sent 101 values
        q.note("c", "a", "shape_mismatch", epoch, 0.0, numel=100)  # a sent 100
    made = q.settle(3, 1.0, layout=100)  # every replica's model has 100 parameters
    assert [(r.peer_id, r.reason) for r in made] == [("c", "shape_mismatch")]


def test_the_layout_is_what_most_ready_replicas_report():
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.coordinator.progress import ProgressReport, ProgressTracker

    t = ProgressTracker(Membership(MembershipConfig()), target_batch_size=8)
    t.ready |= {"a", "b", "c"}
    for peer, numel in (("a", 100), ("b", 100), ("c", 101)):
        t.reports[peer] = ProgressReport(peer, 0, 0, numel=numel)
    assert t._layout() == 100
    t.ready.discard("b")
    assert t._layout() == 100  # a 1-vs-1 tie goes to the smallest peer id's
