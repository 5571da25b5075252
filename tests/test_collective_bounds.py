"""Bounded contributions and checked results, driven without Ray:
averagers in one event loop joined by ``transport.LocalNetwork`` (the production
``Averager`` and ``GroupRound``, the transport swapped).

- a peer sending 3e38 values and one sending weight 1e30 are rejected with typed reasons,
  counted, and quarantined by the Coordinator's rule; every peer's result is the exact
  average of the healthy ones;
- a healthy fp16 element of 1e6 crosses the wire (scaled, not inf) and nobody is blamed;
- a weighted mean that overflows (bounds loosened on purpose) fails the step with
  ``AveragingError`` at every peer instead of handing inf on.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from moshray.cluster.collective.averager import AveragingError
from moshray.cluster.collective.codecs import max_abs_error_bound
from moshray.cluster.collective.partition import ContributionBounds
from moshray.cluster.coordinator.quarantine import Quarantine
from moshray.cluster.messages import RejectReason
from test_allreduce_local import TIMEOUT, inputs, reduce_all, swarm, weighted


def test_poisoned_values_and_weights_are_rejected_counted_and_quarantined():
    _, averagers, first = swarm(4)
    quarantine = Quarantine(threshold=3, window_s=60.0)
    quarantined = {}
    healthy = ["p0", "p3"]
    for step in range(3):
        plan = dataclasses.replace(first, epoch=first.epoch + step)
        arrays, weights = inputs(4, seed=step)
        arrays["p1"] = np.full(1000, 3e38, np.float32)  # finite, poisoned
        weights["p2"] = 1e30
        results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
        expected = weighted(arrays, weights, healthy)
        ref = results["p0"][0]
        for pid, (out, report) in results.items():
            # every part's owner (the poisoned ones too: they reject their own value)
            # averaged the healthy peers only, so all hold the same, exact average
            assert np.array_equal(out, ref), pid
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
            assert report.total_weight == pytest.approx(weights["p0"] + weights["p3"])
            assert np.isfinite(out).all()
        for pid in healthy:
            report = results[pid][1]
            seen = {(r.sender, r.reason) for r in report.rejections}
            assert ("p1", RejectReason.VALUE_OUT_OF_BOUNDS) in seen, pid
            assert ("p2", RejectReason.WEIGHT_OUT_OF_BOUNDS) in seen, pid
            assert set(report.contributors) == set(healthy)
            # the replica reports what it saw; the Coordinator's quarantine counts it
            for r in report.rejections:
                if r.sender != pid:
                    record = quarantine.note(pid, r.sender, r.reason.value, plan.epoch,
                                             now=float(step), numel=r.numel)
                    if record is not None:
                        quarantined[record.peer_id] = record.reason
    for pid in healthy:
        counts = averagers[pid].rejection_counts
        assert counts["value_out_of_bounds"] >= 3 and counts["weight_out_of_bounds"] >= 3
    assert quarantined == {"p1": "value_out_of_bounds", "p2": "weight_out_of_bounds"}


def test_a_healthy_fp16_element_of_1e6_crosses_the_wire_within_the_codec_bound():
    """Over fp16's 65504 the part is scaled before encoding: no inf, no rejection, and the
    error stays within the documented bound of the two encodings."""
    _, averagers, plan = swarm(3, compression="fp16")
    arrays, weights = inputs(3, seed=5)
    arrays["p1"][123] = 1e6
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    bound = max(max_abs_error_bound(a, "fp16") for a in arrays.values())
    bound += max_abs_error_bound(expected.astype(np.float32), "fp16")
    ref = results["p0"][0]
    for pid, (out, report) in results.items():
        assert report.rejections == (), pid
        assert np.array_equal(out, ref), pid
        assert np.isfinite(out).all()
        assert np.abs(out - expected).max() <= bound


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_a_result_that_overflows_fails_the_step_at_every_peer():
    """Bounds loosened past float32's range accept two values of 3e38, whose weighted
    sum is inf: the step errors (``AveragingError``) instead of returning inf."""
    loose = ContributionBounds(value_floor=float("inf"), max_value=float("inf"))
    _, averagers, plan = swarm(2, bounds=loose)
    arrays = {p: np.full(64, 3e38, np.float32) for p in averagers}
    weights = {p: 1.0 for p in averagers}

    async def one(pid):
        try:
            await averagers[pid].all_reduce([arrays[pid]], weights[pid], plan, TIMEOUT)
        except AveragingError as exc:
            return exc
        return None

    async def both():
        return await asyncio.gather(*(one(p) for p in averagers))

    errors = asyncio.run(both())
    assert all(isinstance(e, AveragingError) for e in errors), errors
    assert all(e.epoch == plan.epoch and "not finite" in str(e) for e in errors)
    import pickle

    back = pickle.loads(pickle.dumps(errors[0]))  # crosses actor calls as itself
    assert isinstance(back, AveragingError) and str(back) == str(errors[0])


def test_a_poisoned_result_is_re_reduced_by_the_receivers():
    """An owner whose published result is replaced on the wire by 3e38 values (a transport
    wrapper: the owner's own code is untouched) is treated like a dead owner: every other
    member re-reduces that part from the contributions it holds (the owner never sent its
    own slice of it) and gets the exact average of those; the other parts are exact."""
    from moshray.cluster.collective import codecs
    from moshray.cluster.collective.partition import group_part_sizes, part_slices
    from moshray.cluster.messages import Inline, PartResult

    _, averagers, plan = swarm(3)
    liar = "p2"
    transport = averagers[liar].transport
    original = transport.send

    def poisoning(handle, method, message):
        if isinstance(message, PartResult):
            junk = codecs.encode(np.full(message.ref.value.numel, 3e38, np.float32), "none")
            message = dataclasses.replace(message, ref=Inline(junk))
        return original(handle, method, message)

    transport.send = poisoning
    arrays, weights = inputs(3, seed=9)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    honest = [p for p in averagers if p != liar]
    members = plan.grid.rounds[0].groups[0].members
    lied = part_slices(group_part_sizes(plan, members, 1000))[members.index(liar)]
    expected[lied] = weighted(arrays, weights, honest)[lied]
    for pid in honest:
        out, report = results[pid]
        assert liar in report.failed_owners, pid
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(results[honest[0]][0], results[honest[1]][0])
