"""Where a shell command runs: a bubblewrap sandbox when the machine has one, otherwise
unconfined but still reaped.

In the sandbox (``bwrap``) the command sees the work directory writable and nothing else
writable: the system's programs (``/usr`` and a short list of ``/etc`` files) read-only, its own
``/tmp`` (tmpfs), a minimal ``/proc`` (what sets the whole machine read-only) and ``/dev``, no
network unless allowed, its own PID, IPC, UTS, cgroup and user namespaces, no capabilities, and
resource limits (``prlimit``). ``/root``, ``/home``, the drone's own files and the drone's
environment are not there.

Every process a command starts ends with it: bwrap's PID namespace dies with its first process,
and ``--die-with-parent`` kills it when the drone dies, even by SIGKILL. Without bubblewrap, a
PID namespace made by ``unshare`` (with ``setpriv --pdeathsig``) does the same where the machine
allows it (root, or unprivileged user namespaces); otherwise only the process group is killed.

Call ``detect_sandbox()`` once at start: it runs bubblewrap once to see that it works here.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

SYSTEM_ETC = (
    "alternatives", "ca-certificates", "ca-certificates.conf", "debian_version", "gai.conf",
    "gitconfig", "group", "host.conf", "hosts", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "localtime", "magic", "magic.mime", "mime.types", "nsswitch.conf", "os-release", "passwd",
    "protocols", "python3", "python3.11", "python3.12", "python3.13", "services", "ssl/certs",
    "ssl/openssl.cnf", "terminfo", "timezone",
)  # fmt: skip
"""What the sandbox sees of ``/etc``: enough for sh, coreutils, python3, git and TLS. Files that
hold secrets or other users' settings (shadow, ssh, ssl/private, pip.conf, npmrc) stay out."""

KERNEL_SETTINGS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
"""The parts of ``/proc`` that set the whole machine, read-only in the sandbox: a drone run as
root is still uid 0 there, and writing them asks only for their owner's permission, not a
capability (``kernel/core_pattern`` would run a program as the host's root)."""

NETWORK_ETC = ("resolv.conf",)
"""Added only when the network is allowed (name resolution)."""

SINGLE_INIT = 'sh -c "$1" & wait $!'
"""The first process of an ``unshare`` PID namespace: a shell that only waits for the command.
The kernel ignores SIGTERM sent to a namespace's first process (it has no handler), so the
command runs as its child and gets the abort's SIGTERM itself; its exit status is passed on."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of every process a shell command starts (``prlimit``, inherited by
    children). Measured: sh, coreutils, python3, git, cc, node 20 and Java 17 start within 4 GiB
    of address space (Java 17 does not within 2 GiB). The process limit counts the user's
    processes in the command's own user namespace, and does not bind root (the kernel exempts
    uid 0); see docs/performance.md."""

    cpu_seconds: int = 300
    address_space: int = 4 << 30
    file_size: int = 1 << 30
    processes: int = 512
    tmp_size: int = 1 << 30
    """Size of the sandbox's own ``/tmp`` (memory-backed)."""
    shm_size: int = 64 << 20
    """Size of its ``/dev/shm`` (memory-backed: POSIX shared memory, semaphores)."""

    def prlimit(self, *, count_processes: bool = True) -> list[str]:
        """The ``prlimit … --`` prefix, or nothing where ``prlimit`` is missing.

        Without a user namespace of its own the process limit would count every process of the
        drone's user (a desktop session's threads too): ``count_processes=False`` leaves it out.
        """
        found = _which("prlimit")
        if found is None:
            return []
        limits = [
            f"--cpu={self.cpu_seconds}",
            f"--as={self.address_space}",
            f"--fsize={self.file_size}",
        ]
        if count_processes:
            limits.append(f"--nproc={self.processes}")
        return [found, *limits, "--"]


@dataclass(frozen=True)
class Sandbox:
    """A bubblewrap sandbox: ``argv`` turns a command line into the ``bwrap`` invocation."""

    bwrap: str
    limits: Limits = field(default_factory=Limits)

    def argv(self, workdir: Path, command: str, *, network: bool) -> list[str]:
        root = str(workdir.resolve())
        args = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",  # no nested user namespaces: less kernel surface
            "--cap-drop", "ALL",  # as root, bwrap would keep every capability in its namespace
            "--die-with-parent",
            "--new-session",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        if network:
            args.append("--share-net")
        for name in ("bin", "lib", "lib64", "lib32", "sbin"):
            usr = Path("/usr", name)
            if Path("/", name).is_symlink() and usr.is_dir():
                args += ["--symlink", f"usr/{name}", f"/{name}"]
            elif Path("/", name).is_dir():
                args += ["--ro-bind", f"/{name}", f"/{name}"]
        for name in SYSTEM_ETC + (NETWORK_ETC if network else ()):
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        args += [
            "--size", str(self.limits.tmp_size), "--tmpfs", "/tmp",
            "--proc", "/proc",
        ]  # fmt: skip
        for name in KERNEL_SETTINGS:  # after --proc: over the sandbox's own /proc
            args += ["--ro-bind-try", name, name]
        args += [
            "--dev", "/dev",
            "--size", str(self.limits.shm_size), "--tmpfs", "/dev/shm",
            # The sandbox's root and /dev are memory too: nothing is written there (device
            # files stay writable on a read-only mount).
            "--remount-ro", "/dev",
            "--remount-ro", "/",
            # Last, so that a work directory under /tmp or /dev is the real one.
            "--bind", root, root,
            "--chdir", root,
            "--clearenv",  # the drone's environment holds its token and API keys
            "--setenv", "PATH", PATH,
            "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "TMPDIR", "/tmp",
            "--",
        ]  # fmt: skip
        return [*args, *self.limits.prlimit(), "/bin/sh", "-c", command]

    @property
    def environment(self) -> dict[str, str]:
        """bwrap's own environment: none of the drone's. bwrap stays in the sandbox as its
        PID 1, and its ``/proc/1/environ`` is readable there (``--clearenv`` is for the
        command's)."""
        return {"PATH": PATH}

    def describe(self, *, network: bool) -> str:
        reach = "with network" if network else "no network"
        return f"Shell commands run in a bubblewrap sandbox (work directory writable, {reach})."


@dataclass(frozen=True)
class Unconfined:
    """No sandbox: the command runs as the drone's user, in the drone's environment.

    ``reaper`` is the prefix that still ties the command's processes to it and to the drone (a
    PID namespace with a parent-death signal), or empty where the machine allows none.
    """

    reaper: tuple[str, ...] = ()
    pid_namespace: bool = False
    limits: Limits = field(default_factory=Limits)

    def argv(self, workdir: Path, command: str, *, network: bool) -> list[str]:
        del workdir, network  # cwd is set by the caller; the network is the host's
        if self.pid_namespace:
            shell = ["/bin/sh", "-c", SINGLE_INIT, "hangar-init", command]
        else:
            shell = ["/bin/sh", "-c", command]
        limits = self.limits.prlimit(count_processes=self.pid_namespace)
        return [*self.reaper, *limits, *shell]

    environment = None
    """The drone's own (``None``: inherited)."""

    def describe(self) -> str:
        """How commands are tied to their end, for the operator and the benchmark."""
        if self.pid_namespace:
            return "in a PID namespace that ends with the command and with the drone"
        return "in a process group (a child that leaves it may outlive an abort)"


@dataclass(frozen=True)
class SandboxStatus:
    """What ``detect_sandbox`` found: the sandbox, or why there is none."""

    sandbox: Sandbox | None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.sandbox is not None

    def describe(self, *, network: bool) -> str:
        """One line for the drone's operator, printed at start."""
        if self.sandbox is not None:
            return self.sandbox.describe(network=network)
        return f"No sandbox available ({self.reason}): shell commands run unconfined."


@functools.cache
def detect_sandbox() -> SandboxStatus:
    """Find ``bwrap`` and check that it can make its namespaces here (a ``true`` in a sandbox
    over a scratch directory); cached, since the machine does not change under the drone."""
    found = shutil.which("bwrap")
    if found is None:
        return SandboxStatus(None, "bubblewrap not found")
    sandbox = Sandbox(found)
    with tempfile.TemporaryDirectory(prefix="hangar-probe-") as scratch:
        problem = _probe(sandbox.argv(Path(scratch), "true", network=False))
    if problem:
        return SandboxStatus(None, f"bubblewrap does not work here: {problem}")
    return SandboxStatus(sandbox)


@functools.cache
def unconfined() -> Unconfined:
    """The best reaper this machine allows without bubblewrap (probed once, cached)."""
    setpriv, unshare = shutil.which("setpriv"), shutil.which("unshare")
    if setpriv is None or unshare is None:
        return Unconfined()
    death = (setpriv, "--pdeathsig", "KILL", "--")
    pid_namespace = ("--pid", "--fork", "--kill-child", "--")
    candidates: list[tuple[str, ...]] = [(*death, unshare, *pid_namespace)]
    if os.geteuid() != 0:  # a PID namespace needs root, or a user namespace of one's own
        candidates.append((*death, unshare, "--map-current-user", *pid_namespace))
    for reaper in candidates:
        if not _probe([*reaper, "true"]):
            return Unconfined(reaper, pid_namespace=True)
    return Unconfined(death)


@functools.cache
def _which(program: str) -> str | None:
    return shutil.which(program)


def _probe(argv: list[str]) -> str:
    """Run ``argv``; '' if it succeeded, else the first line of what it said."""
    try:
        # Out of the terminal's process group: a Ctrl-C as the drone starts is the drone's to
        # handle, and would otherwise read as a sandbox that does not work.
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False, process_group=0)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode == 0:
        return ""
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return said[0] if said else f"exit code {done.returncode}"
