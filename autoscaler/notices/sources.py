"""Building a node's notice source by name (``make_source``, ``source_names``) and
``AutoSource``, the source ``auto`` picked, which says how its cloud was found.

A source's name is a registered cloud's (``autoscaler/clouds``: that cloud's bundle builds
it), ``simulated``, ``sigterm`` (no polling: the watcher process's SIGTERM is the notice,
``moshray watch --grace-s``; a pod that cannot reach the metadata service) or ``none``; ``auto`` is resolved by the watcher's config, which detects
the cloud and then asks here. The names are read from the registry when asked, so a cloud
registered later is accepted without edits here.
"""
from __future__ import annotations

from moshray.autoscaler.clouds.base import cloud_names, get_cloud
from moshray.autoscaler.clouds.detect import Detection
from moshray.autoscaler.notices.local import SilentSource, SimulatedSource
from moshray.autoscaler.notices.message import SIGTERM, SIMULATED, NoticeSource, PreemptionNotice

AUTO = "auto"
NONE = "none"


def source_names(*, auto: bool = True, simulated: bool = True,
                 sigterm: bool = True) -> tuple[str, ...]:
    """The names a notice source may be given: ``auto`` (if ``auto``), every registered
    cloud, ``simulated`` (if ``simulated``: local clusters and tests), ``sigterm`` (if
    ``sigterm``: a ``moshray watch`` process's own signal; a watcher a job starts gets none)
    and ``none``."""
    return ((AUTO,) if auto else ()) + cloud_names() + ((SIMULATED,) if simulated else ()) \
        + ((SIGTERM,) if sigterm else ()) + (NONE,)


class AutoSource(NoticeSource):
    """The source ``auto`` picked (``WatcherConfig.make_source``): ``inner`` does the work,
    ``detection`` says how its cloud was found.

    Polls, ``close``, ``errors`` and ``cloud`` are the inner source's; other attributes
    (``node_id``, ``pool``, ``base_url``...) are read through. ``describe()`` is the inner
    source's followed by ``(auto: <how>)``, so a watcher's ``status()["source"]`` shows it;
    notices keep the inner source's own description.
    """

    def __init__(self, inner: NoticeSource, detection: Detection) -> None:
        self.inner = inner
        self.detection = detection

    @property
    def cloud(self) -> str:
        return self.inner.cloud

    @property
    def errors(self) -> int:
        return self.inner.errors

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        return self.inner.poll(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"{self.inner.describe()} (auto: {self.detection.how})"

    def __getattr__(self, name: str):
        if name in ("inner", "detection"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_source(kind: str, node_id: str, *, metadata_url: str | None = None, pool: str = "",
                **options) -> NoticeSource:
    """The source named ``kind`` (``source_names(auto=False)``: a registered cloud,
    ``simulated`` or ``none``) for ``node_id``.

    For a cloud, its bundle's ``notice_source`` builds it, polling ``metadata_url`` (default:
    the cloud's link-local metadata address); ``options`` go to the source's constructor
    (e.g. ``interval_s`` for AWS, ``notice_s`` for GCP). ``auto`` is not a kind here:
    ``WatcherConfig.make_source`` detects the cloud, then calls this. Raises ``ValueError``
    for an unknown kind (naming the known ones) or a metadata URL given to ``simulated``.
    """
    if kind in (NONE, SIGTERM):  # sigterm: notices come through the watcher's ``notify``
        return SilentSource(node_id, pool=pool, description=kind if kind == NONE else
                            "sigterm (the watcher's SIGTERM is the notice)")
    if kind == SIMULATED:
        if metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        return SimulatedSource(node_id, pool=pool, **options)
    if kind not in cloud_names():
        raise ValueError(f"notice source must be one of "
                         f"{', '.join(source_names(auto=False))}, got {kind!r}")
    cloud = get_cloud(kind)
    return cloud.notice_source(node_id, metadata_url or cloud.metadata_url, pool=pool,
                               **options)
