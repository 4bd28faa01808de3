"""Which tools a drone runs at once, which wait for a person's approval, and which it refuses.

A policy is written as the drone's operator gives it: ``run_shell=ask,write_file=ask,
fetch_url=allow`` (``--tools``); tools it does not name keep their default. Where the machine has
no sandbox for commands, ``run_shell`` asks before every command whatever the policy, or an
"always" approval, says (unless it is denied).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Rule = Literal["allow", "ask", "deny"]
RULES: tuple[Rule, ...] = ("allow", "ask", "deny")
TOOL_NAMES = (
    "read_file",
    "list_directory",
    "write_file",
    "run_shell",
    "fetch_url",
    "spawn_subagent",
)
DEFAULT_RULES: dict[str, Rule] = {
    "read_file": "allow",
    "list_directory": "allow",
    "write_file": "ask",
    "run_shell": "ask",
    "fetch_url": "allow",
    "spawn_subagent": "allow",
}
"""Commands and writes change things: a person approves them; reading and fetching do not."""


@dataclass(frozen=True)
class ToolPolicy:
    rules: dict[str, Rule] = field(default_factory=lambda: dict(DEFAULT_RULES))
    ask_each_time: frozenset[str] = frozenset()
    """Tools that ask before every call, "Always for this session" notwithstanding."""

    @classmethod
    def parse(cls, text: str) -> ToolPolicy:
        """A policy from ``name=rule,...`` (``all=rule`` sets every tool); raises ``ValueError``
        with a one-line reason for anything else."""
        rules = dict(DEFAULT_RULES)
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, equals, rule = item.partition("=")
            name, rule = name.strip(), rule.strip()
            if not equals or rule not in RULES:
                raise ValueError(f"expected TOOL=allow|ask|deny, got {item!r}")
            if name == "all":
                rules = dict.fromkeys(TOOL_NAMES, rule)
            elif name in TOOL_NAMES:
                rules[name] = rule
            else:
                raise ValueError(f"unknown tool {name!r} (tools: {', '.join(TOOL_NAMES)})")
        return cls(rules)

    @classmethod
    def allow_all(cls) -> ToolPolicy:
        return cls(dict.fromkeys(TOOL_NAMES, "allow"))

    def rule(self, name: str) -> Rule:
        return self.rules.get(name, "allow")

    def unconfined(self) -> ToolPolicy:
        """The policy on a machine with no sandbox: each command waits for a person, also
        after "Always for this session" (given here, or on a sandboxed drone before)."""
        if self.rule("run_shell") == "deny":
            return self
        return ToolPolicy({**self.rules, "run_shell": "ask"}, frozenset({"run_shell"}))

    def describe(self) -> str:
        return ",".join(f"{name}={self.rule(name)}" for name in TOOL_NAMES)
