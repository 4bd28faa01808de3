"""The Python packages Hangar runs on (README, "Quickstart"): ``make install`` takes the
versions in ``constraints.txt``, the set the tests last passed with, and ``pyproject.toml``
admits each of them, so a new release elsewhere never changes what a fresh clone installs."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT


def pinned() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, exact = line.partition("==")
            assert exact, f"constraints.txt: {line!r} is not name==version"
            found[canonicalize_name(name)] = exact
    return found


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return [r for r in map(Requirement, wanted) if r.marker is None or r.marker.evaluate()]


def test_every_requirement_is_pinned_at_a_version_its_range_admits() -> None:
    pins = pinned()
    wrong = []
    for requirement in requirements():
        exact = pins.get(canonicalize_name(requirement.name))
        if exact is None or not requirement.specifier.contains(exact, prereleases=True):
            wrong.append(f"{requirement}: constraints.txt has {exact}")
    assert wrong == []


def test_the_installed_packages_are_the_pinned_versions() -> None:
    wrong = []
    for name, exact in pinned().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "nothing"
        if installed != exact:
            wrong.append(f"{name}: {installed} installed, {exact} pinned")
    assert wrong == []
