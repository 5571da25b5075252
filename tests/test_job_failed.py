"""`moshray train` when the failure policy ends the job (jobs/controller/reconcile.py rule
6): it prints the user's error (with the replica's traceback) and why, and exits non-zero.
``run`` is replaced by one that fails as the controller does; no Ray."""

from __future__ import annotations

import argparse

import moshray.jobs.train as train
from moshray.jobs.controller.elastic import JobFailed


def test_moshray_train_prints_the_users_error_and_exits_non_zero(monkeypatch, capsys):
    error = KeyError("no column 'label'")
    error.add_note("Traceback: File \"loop.py\", line 7, in loop")

    def failing_run(config, job=None, stop_when=None):
        raise JobFailed("the same error on 2 nodes: KeyError: \"no column 'label'\"", error)

    monkeypatch.setattr(train, "run", failing_run)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    code = train.main(parser.parse_args(["--trace", "off"]))
    err = capsys.readouterr().err
    assert code == 4
    assert "no column 'label'" in err
    assert "moshray: the job failed: the same error on 2 nodes" in err


def test_job_failed_pickles_with_its_error():
    import pickle

    failed = pickle.loads(pickle.dumps(JobFailed("why", KeyError("k"))))
    assert (failed.reason, type(failed.error), str(failed)) == ("why", KeyError, "why")
