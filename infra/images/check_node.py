#!/usr/bin/env python3
"""Does a node's Python already hold Ray, torch and moshray at the expected versions?

    python3 check_node.py --python /opt/moshray/bin/python \\
        --ray 2.60.0 --torch 2.13.0 --wheel moshray-0.1.1.dev5+g1a2b3c4-py3-none-any.whl

The node startup scripts (infra/aws, infra/gcp modules/bootstrap, infra/ray/*.yaml) run it
first: a node booted from an image built by infra/images/ passes and skips every download;
any other node installs at boot as before. Standard library only (it runs with the system
python3 before anything is installed); it reads package metadata with ``--python`` in a
subprocess and imports nothing of the packages themselves.

Contract: prints exactly one line and exits 0 ("ok": every version matches, skip the
install) or 1 ("install needed": the interpreter is missing or fails, or a package is absent
or at another version; the line names each). Bad arguments exit 2 with argparse's message.
Versions compare exactly, except that for Ray and torch an expected version without a local
part (``2.13.0``) accepts an installed build variant of it (torch's ``2.13.0+cu128``);
moshray's local part names its build (pyproject [tool.setuptools_scm]): always in full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

OK, INSTALL = 0, 1
PROBE_TIMEOUT_S = 120
PACKAGES = ("ray", "torch", "moshray")
EXACT = ("moshray",)  # its local part names the build: never a variant of another
# Run with the node's interpreter: {distribution: version or None}, metadata only.
PROBE = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for name in %r:\n"
    "    try:\n"
    "        out[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        out[name] = None\n"
    "print(json.dumps(out))\n" % (PACKAGES,)
)


def wheel_version(wheel: str) -> str:
    """The version in a moshray wheel's file name (``.../moshray-<version>-py3-none-any.whl``);
    ValueError (saying what is expected) for any other name."""
    name = wheel.rsplit("/", 1)[-1]
    parts = name[: -len(".whl")].split("-") if name.endswith(".whl") else []
    if len(parts) < 5 or parts[0] != "moshray" or not parts[1]:
        raise ValueError(f"{wheel!r} is not a moshray wheel file name "
                         f"(moshray-<version>-py3-none-any.whl)")
    return parts[1]


def version_matches(installed: str | None, expected: str, exact: bool = False) -> bool:
    """Equal, or (unless ``exact``) ``installed``'s public part when ``expected`` has no
    local part."""
    if installed is None:
        return False
    if "+" not in expected and not exact:
        installed = installed.split("+", 1)[0]
    return installed == expected


def decide(installed: dict[str, str | None], expected: dict[str, str]) -> tuple[int, str]:
    """(exit code, the line to print) for the versions found and those wanted. Pure."""
    wrong = [f"{name} {installed.get(name) or 'missing'} (want {want})"
             for name, want in expected.items()
             if not version_matches(installed.get(name), want, exact=name in EXACT)]
    if wrong:
        return INSTALL, "install needed: " + ", ".join(wrong)
    found = ", ".join(f"{name} {installed[name]}" for name in expected)
    return OK, f"ok: {found} already installed, skipping the install"


def probe(python: str) -> dict[str, str | None] | str:
    """The versions ``python`` sees, or a one-line reason it could not say."""
    try:
        # cwd "/": `python -c` puts the working directory on sys.path, and a checkout's
        # *.egg-info there would answer for the interpreter's own packages.
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, cwd="/")
    except FileNotFoundError:
        return f"no interpreter at {python}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} did not answer ({type(exc).__name__})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} failed: {last}"
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"{python} printed no versions"
    return {name: found.get(name) for name in PACKAGES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="/opt/moshray/bin/python",
                        help="the interpreter the node runs Ray with")
    parser.add_argument("--ray", required=True, help="expected Ray version, e.g. 2.60.0")
    parser.add_argument("--torch", required=True, help="expected torch version, e.g. 2.13.0")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--moshray", help="expected moshray version, in full")
    which.add_argument("--wheel", help="the wheel the node would install (its name)")
    args = parser.parse_args(argv)
    try:
        moshray = args.moshray or wheel_version(args.wheel)
    except ValueError as exc:
        parser.error(str(exc))
    found = probe(args.python)
    if isinstance(found, str):
        print(f"install needed: {found}", flush=True)
        return INSTALL
    code, line = decide(found, {"ray": args.ray, "torch": args.torch, "moshray": moshray})
    print(f"{line} ({args.python})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
