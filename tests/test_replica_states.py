"""How a replica's end is told: ``replica_states.end_line`` over real transitions (pure)."""

from __future__ import annotations


def _lived(*edges: tuple[float, str, str]):
    from moshray.jobs.controller.replica_states import ReplicaRecord, ReplicaState

    record = ReplicaRecord("replica-1-3", "node-1", 0.0, started_at_s=100.0)
    for at_s, state, reason in edges:
        record.to(ReplicaState(state), at_s, reason)
    return record


def test_a_replicas_end_is_said_once_in_the_words_of_the_run():
    from moshray.jobs.controller.replica_states import end_line

    never = _lived((103.0, "syncing", "registered"), (109.0, "gone", "node lost"))
    assert end_line(never) == ("replica-1-3 ended before it trained, 9 s after it started "
                               "(node lost)")
    noticed = _lived((103.0, "syncing", "registered"), (105.0, "training", "ready"),
                     (146.0, "leaving", "node noticed"), (150.0, "gone", "node lost"))
    assert end_line(noticed) == ("replica-1-3 left after 41 s of training (its node's "
                                 "notice; node lost)")
    # a resync in between: only the time in training counts
    hard = _lived((101.0, "syncing", "registered"), (102.0, "training", "ready"),
                  (110.0, "syncing", "resync"), (130.0, "training", "ready"),
                  (134.0, "gone", "run died"))
    assert end_line(hard) == "replica-1-3 lost after 12 s of training: no notice (run died)"
    done = _lived((101.0, "syncing", "registered"), (102.0, "training", "ready"),
                  (182.0, "gone", "run finished"))
    assert end_line(done) == "replica-1-3 finished after 80 s of training"
    failed = _lived((101.0, "syncing", "registered"), (102.0, "training", "ready"),
                    (112.0, "gone", "run raised"))
    assert end_line(failed) == ("replica-1-3 failed after 10 s of training (its error is "
                                "logged above)")
