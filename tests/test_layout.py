"""How Hangar installs and where its parts meet (``docs/architecture.md``, "Parts"): one
``hangar.*`` namespace that carries the page, and a relay and a drone that meet only on the
wire."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp

from tests.conftest import HANGAR, ROOT, eventually

SDKS = ("openai", "ollama", "httpx")


def imports_of(folder: str) -> dict[str, set[str]]:
    """Every module each Python file under ``folder`` imports (absolute names)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path}: {name}"
        for path, names in imports_of(folder).items()
        for name in names
        if name.startswith(forbidden) or name.split(".")[0] in forbidden
    )


def test_the_relay_imports_neither_the_drone_nor_a_model_sdk() -> None:
    assert offending("server", ("hangar.drone", *SDKS)) == []


def test_the_drone_does_not_import_the_relay() -> None:
    assert offending("drone", ("hangar.server",)) == []


def test_the_shared_part_imports_neither_side() -> None:
    assert offending("shared", ("hangar.server", "hangar.drone", *SDKS)) == []


PARTS = {"server": "hangar.server", "drone": "hangar.drone", "shared": "hangar.shared"}
MAX_MODULE_LINES = 400


def module_graph() -> dict[str, set[str]]:
    """Which ``hangar.*`` modules each module imports when it is loaded (not for typing).

    A module's own packages are left out: importing a module loads them first in any case.
    """
    files: dict[str, Path] = {}
    for folder, package in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT / folder).with_suffix("")
            files[".".join([package, *(p for p in relative.parts if p != "__init__")])] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:  # ``from . import shell`` imports a module
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        ancestors = {name.rsplit(".", n)[0] for n in range(1, name.count("."))}
        graph[name] = {m for m in found if m in files and m not in ancestors and m != name}
    return graph


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph = module_graph()
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target in graph and len(path) < 50:
                visit(target, [*path, target])

    for module in sorted(graph):
        visit(module, [module])
    assert len(graph) > 40  # the walk found the modules
    assert cycles == []


def test_every_module_stays_small_enough_to_read_in_one_sitting() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in PARTS
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}
    assert len((ROOT / "web" / "app.js").read_text().splitlines()) < 300


def test_no_code_imports_the_old_top_level_names() -> None:
    old = ("server", "drone", "shared")
    for folder in ("server", "drone", "shared", "tests", "bench"):
        assert offending(folder, old) == [], folder


async def test_a_running_relay_has_loaded_no_drone_and_no_model_sdk(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    process = await start_logged(
        log,
        [sys.executable, "-X", "importtime", *HANGAR[1:], "serve", "--port", "0",
         "--database", str(tmp_path / "relay.db"), "--drone-token", "t" * 24],
        cwd=ROOT,
    )  # fmt: skip
    try:
        url = await eventually(
            lambda: re.search(r"listening on (http://\S+)/", log.read_text()),
            timeout=20,
            what="the relay to listen",
        )
        async with aiohttp.ClientSession() as http, http.get(url.group(1) + "/healthz") as ok:
            assert ok.status == 200
    finally:
        await stop(process)
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", log.read_text(), re.M))
    assert "hangar.server.app" in imported
    assert sorted(n for n in imported if n.split(".")[0] in SDKS or "hangar.drone" in n) == []


def _build_wheel(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(directory), "."],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    (wheel,) = directory.glob("hangar-*.whl")
    return wheel


async def test_a_wheel_holds_only_the_hangar_namespace_and_serves_the_page(
    tmp_path: Path,
) -> None:
    wheel = await asyncio.to_thread(_build_wheel, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"hangar", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "hangar/__init__.py" not in names  # a namespace others' hangar.* could join
    for page_file in ("index.html", "login.html", "app.js", "vendor/socket.io.esm.min.js"):
        assert f"hangar/web/{page_file}" in names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    log = tmp_path / "wheel-relay.log"
    env = {**os.environ, "PYTHONPATH": str(site), "HANGAR_WEB_DIR": ""}
    # Run from an empty folder: nothing of the checkout is on the path, only the wheel.
    added = await asyncio.create_subprocess_exec(
        *HANGAR, "user", "add", "wheelie", "--password-stdin", "--database", str(tmp_path / "w.db"),
        cwd=tmp_path, env=env, stdin=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.wait_for(added.communicate(b"a wheel's password\n"), 30)
    assert added.returncode == 0
    process = await start_logged(
        log,
        [*HANGAR, "serve", "--port", "0", "--database", str(tmp_path / "w.db"),
         "--drone-token", "t" * 24],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        url = await eventually(
            lambda: re.search(r"listening on (http://\S+)/", log.read_text()),
            timeout=20,
            what="the relay from the wheel to listen",
        )
        base = url.group(1)
        # unsafe: keep cookies of an IP address host (127.0.0.1) as a browser does
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            for path in ("/login", "/static/app.js", "/static/vendor/socket.io.esm.min.js"):
                async with http.get(base + path) as response:
                    assert response.status == 200, path
            form = {"username": "wheelie", "password": "a wheel's password"}
            async with http.post(base + "/login", data=form) as page:
                assert page.url.path == "/"
                assert "<title>Hangar</title>" in await page.text()
    finally:
        await stop(process)
    found = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import hangar.web, hangar.server; print(hangar.web.__file__, hangar.server.__file__)",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    where = (await asyncio.wait_for(found.communicate(), 30))[0].decode().split()
    assert len(where) == 2 and all(path.startswith(str(site)) for path in where), where


async def start_logged(
    log: Path, argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """Start ``argv`` with its output going to ``log``."""
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
    await asyncio.wait_for(process.wait(), 10)
