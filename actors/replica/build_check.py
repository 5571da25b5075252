"""Which moshray build a process runs, and the replica's refusal of a driver of another build.

moshray's version is derived from git when the wheel is built (pyproject
``[tool.setuptools_scm]``: ``0.1.1.dev5+g1a2b3c4``, with a timestamp for uncommitted changes),
so it names the build. The driver puts its build into the ``ReplicaSpec`` it ships
(``jobs/controller/replica_launch.py``); a replica on a node whose installed moshray differs refuses to
run with a ``UserError``, which the controller turns into a stop of the whole job
(``jobs/controller/elastic.py _outcome``): a node of another build would run other code under the
same protocol, and retrying it elsewhere cannot help when images or wheels disagree.
"""

from __future__ import annotations

from importlib import metadata

from moshray.actors.errors import UserError

DISTRIBUTION = "moshray"
UNKNOWN = "unknown"  # moshray imported from a source tree that was never installed


def installed_build() -> str:
    """This install's moshray build: ``moshray/_version.py``, which every build writes (a
    wheel carries its own; an editable install reads the checkout's, from its latest build),
    else the distribution's metadata, else ``"unknown"`` (a source tree never built)."""
    try:
        from moshray._version import version

        return str(version)
    except ImportError:
        pass
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def build_mismatch(driver: str | None, here: str, node: str) -> UserError | None:
    """The error a replica on ``node`` raises when its build ``here`` differs from the
    driver's ``driver``; None when they are equal or the driver sent none (a caller that
    does not check). Pure; the message is one line saying what to fix."""
    if driver is None or driver == here:
        return None
    return UserError("version", f"the driver runs moshray {driver} but node {node} has "
                                f"moshray {here}; head and workers must run the same build: "
                                f"install the driver's wheel or image on every node "
                                f"(infra/images/README.md)")
