"""Check that a lock file is closed and consistent for one platform, from the packages' metadata.

    python requirements/check_lock.py requirements/gpu.txt [--python 3.11] [--index https://pypi.org/simple]

For every ``name==version`` line it reads the ``Requires-Dist`` of the release's wheel for the
platform from the index (PEP 691 JSON listing + PEP 658 metadata file: no wheel is downloaded), evaluates the environment markers for linux x86_64 / CPython at
``--python`` (with the extras other pins request), and reports each requirement that names a
package the lock does not pin (``missing``) or a pinned version outside the specifier
(``conflict``). Exit 0 when there is neither, 1 otherwise, 2 when metadata cannot be fetched.
Two distributions that install the same import package (a fork under another name) cannot be
seen in metadata: the lock's header must say how that is avoided.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{path}: not an exact pin: {line!r}")
        pins[canonicalize_name(name.split("[")[0])] = version.strip()
    return pins


def _wheel_fits(filename: str, python: str) -> bool:
    """Whether a wheel installs on linux x86_64 / CPython ``python`` (e.g. ``3.11``)."""
    from packaging.utils import parse_wheel_filename

    minor = int(python.split(".")[1])

    def minor_of(interp: str, prefix: str) -> int | None:
        rest = interp.removeprefix(prefix)
        return None if not rest.startswith("3") else (int(rest[1:]) if rest[1:].isdigit() else 0)

    for tag in parse_wheel_filename(filename)[3]:
        py = minor_of(tag.interpreter, "py") if tag.interpreter.startswith("py") else None
        cp = minor_of(tag.interpreter, "cp") if tag.interpreter.startswith("cp") else None
        interp_ok = (py is not None and py <= minor) or (cp == minor) or \
            (cp is not None and tag.abi == "abi3" and cp <= minor)
        plat_ok = tag.platform == "any" or (tag.platform.startswith(("manylinux", "linux")) and
                                            tag.platform.endswith("x86_64"))
        if interp_ok and plat_ok:
            return True
    return False


def requires_dist(index: str, name: str, version: str, python: str = "3.11", tries: int = 3) -> list[str] | str:
    """:func:`_requires_dist`, tried again on a network error (a name that fails to resolve once)."""
    for _ in range(tries):
        out = _requires_dist(index, name, version, python)
        if not isinstance(out, str) or not out.startswith(("URLError", "BadZipFile", "TimeoutError")):
            return out
    return out


def _requires_dist(index: str, name: str, version: str, python: str = "3.11") -> list[str] | str:
    """The ``Requires-Dist`` of a wheel of the release that fits linux x86_64 / CPython ``python``
    (its PEP 658 ``.metadata`` file, found through the simple JSON API), or why it could not be read."""
    from email.parser import Parser

    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    try:
        request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        wheels = [f for f in files if f["filename"].endswith(".whl")
                  and parse_wheel_filename(f["filename"])[1] == Version(version) and _wheel_fits(f["filename"], python)]
        if not wheels:
            return f"no wheel of {version} for linux x86_64 / Python {python}"
        try:
            with urllib.request.urlopen(wheels[0]["url"] + ".metadata", timeout=60) as response:
                text = response.read().decode()
        except OSError:  # no PEP 658 file served: read METADATA out of the wheel with range requests
            text = _metadata_from_wheel(wheels[0]["url"])
        return Parser().parsestr(text).get_all("Requires-Dist") or []
    except (OSError, ValueError, KeyError, StopIteration, zipfile.BadZipFile) as err:
        return f"{type(err).__name__}: {err}"


class _RemoteFile(io.RawIOBase):
    """A seekable read-only view of a URL through HTTP range requests (zipfile reads the
    central directory at the end and one member, not the whole wheel)."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            self.size = int(response.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            data = response.read()
        self.pos += len(data)
        return data


def _metadata_from_wheel(url: str) -> str:
    with zipfile.ZipFile(_RemoteFile(url)) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return wheel.read(name).decode()


def check(pins: dict[str, str], meta: dict[str, list[str]], python: str) -> list[str]:
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    extras: dict[str, set[str]] = {name: set() for name in pins}  # pins without metadata request nothing
    changed = True
    while changed:  # extras requested by other pins' requirements, until nothing new is requested
        changed = False
        for name, reqs in meta.items():
            for text in reqs:
                req = Requirement(text)
                if _applies(req, env, extras[name]) and canonicalize_name(req.name) in extras:
                    new = set(req.extras) - extras[canonicalize_name(req.name)]
                    if new:
                        extras[canonicalize_name(req.name)] |= new
                        changed = True
    problems = []
    for name, reqs in sorted(meta.items()):
        for text in reqs:
            req = Requirement(text)
            if not _applies(req, env, extras[name]):
                continue
            dep = canonicalize_name(req.name)
            if dep not in pins:
                problems.append(f"missing: {name}=={pins[name]} requires {text!r}; the lock has no {dep}")
            elif req.specifier and not req.specifier.contains(pins[dep], prereleases=True):
                problems.append(f"conflict: {name}=={pins[name]} requires {text!r}; the lock pins {dep}=={pins[dep]}")
    return problems


def _applies(req: Requirement, env: dict, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras | {""}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lock", type=Path)
    parser.add_argument("--python", default="3.11")
    parser.add_argument("--index", default="https://pypi.org/simple", help="a simple-API root that serves JSON "
                        "(PEP 691) and wheel metadata files (PEP 658), as PyPI does")
    args = parser.parse_args(argv)
    pins = read_lock(args.lock)
    try:
        with ThreadPoolExecutor(16) as pool:
            meta = dict(zip(pins, pool.map(lambda kv: requires_dist(args.index, *kv, args.python), pins.items())))
    except OSError as err:
        print(f"check_lock: cannot read metadata from {args.index}: {err}", file=sys.stderr)
        return 2
    unread = {name: why for name, why in meta.items() if isinstance(why, str)}
    if len(unread) == len(pins):
        print(f"check_lock: cannot read any metadata from {args.index}: {next(iter(unread.values()))}", file=sys.stderr)
        return 2
    meta = {name: reqs for name, reqs in meta.items() if name not in unread}
    problems = [f"unknown: {name}=={pins[name]}: no metadata on the index ({why})" for name, why in unread.items()]
    problems += check(pins, meta, args.python)
    for line in problems:
        print(line)
    print(f"check_lock: {len(pins)} pins, {sum(len(v) for v in meta.values())} requirements read, "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
