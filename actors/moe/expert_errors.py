"""Typed refusals of expert requests.

Contract: a bad request (unknown expert, wrong shape or dtype, NaN/inf, malformed call) raises
``ExpertInputError`` carrying an ``ExpertRejectReason``, the uid and a detail; it pickles with
its fields, so a Ray caller gets the typed error and the expert host keeps serving.
"""

from __future__ import annotations

import enum

__all__ = ["ExpertInputError", "ExpertRejectReason"]


class ExpertRejectReason(str, enum.Enum):
    """Why an expert refused a request."""

    BAD_REQUEST = "bad_request"  # malformed call: lengths differ, not an array, ...
    UNKNOWN_EXPERT = "unknown_expert"  # this host does not serve the uid
    BAD_SHAPE = "bad_shape"  # not (rows, d_model), or grads shaped unlike inputs
    BAD_DTYPE = "bad_dtype"  # not float32
    NON_FINITE = "non_finite"  # NaN or inf in inputs or grads


class ExpertInputError(ValueError):
    """A request an expert refused; ``reason``, ``uid`` and ``detail`` say what to fix.

    Pickles with its fields, so a Ray caller can read ``exc.reason`` (Ray re-raises it as a
    ``RayTaskError`` subclass that is also an ``ExpertInputError``).
    """

    def __init__(self, reason: ExpertRejectReason, uid: str, detail: str):
        self.reason = ExpertRejectReason(reason)
        self.uid = uid
        self.detail = detail
        super().__init__(f"expert {uid}: {self.reason.value}: {detail}")

    def __reduce__(self):
        return (type(self), (self.reason, self.uid, self.detail))
