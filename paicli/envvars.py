"""A job's own environment variables: `-Denv=K=V,K2=V2` and YAML `env:` (a mapping).

On every backend an instance's environment is its NODE's own (on this machine the
one `pai` runs in), then the job's declared variables, then the launcher's PAI_*
ones: nothing of the submitting shell crosses to another machine unless declared.
A bare name (`-Denv=HF_TOKEN`) takes its value from the submitting shell, so a
token is never typed on a command line. Values of names that look like secrets
(SECRET_MARKS) are masked as MASK wherever paicli shows them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_MARKS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")
MASK = "***"
# Values shorter than this are not masked: blanking every "1" of a log hides
# nothing and ruins the log.
MIN_MASKED = 4
MAX_VARS = 256
MAX_VALUE = 64 * 1024
# What the launcher sets on every instance (paicli/jobplan.py): a job cannot declare them.
RESERVED = frozenset({"PAI_JOB_ID", "PAI_ROLE", "PAI_INDEX", "PAI_HOST", "PAI_NODE", "PAI_PORT",
                      "PAI_CLUSTER", "PAI_ATTEMPT", "PAI_JOB_ATTEMPT", "PAI_JOB_DIR",
                      "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED"})


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(mark in upper for mark in SECRET_MARKS)


def _split_items(text: str) -> list[str]:
    """K=V,K2=V2 with `\\,` for a comma inside a value."""
    items, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append(char if char in ",\\" else "\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ",":
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if escaped:
        current.append("\\")
    items.append("".join(current))
    return [item for item in items if item.strip()]


def _from_shell(name: str, shell: Mapping[str, str]) -> str:
    if name not in shell:
        raise ValueError(f"{name} is named without a value but is not set in your shell; "
                         f"give it as {name}=VALUE or export it before submitting")
    return shell[name]


def _check(name: Any, value: Any) -> tuple[str, str]:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a variable name (letters, digits and _, not starting with a digit)")
    if name in RESERVED:
        raise ValueError(f"{name} is set by paicli on every instance and cannot be declared")
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a text value, not {type(value).__name__}")
    text = str(value)
    if "\x00" in text:
        raise ValueError(f"{name}: a value cannot contain a NUL character")
    if len(text) > MAX_VALUE:
        raise ValueError(f"{name}: a value is at most {MAX_VALUE} characters")
    return name, text


class Env(dict):
    """A job's variables; `from_shell` names those given bare, whose values come from
    the submitting shell and so are left out of a job file (`exported`)."""

    from_shell: frozenset[str] = frozenset()


def exported(env: Mapping[str, str]) -> dict[str, str | None]:
    """The YAML `env:` of `pai export`: a bare name stays a name (null), never its value."""
    return {k: None if k in getattr(env, "from_shell", ()) else v for k, v in env.items()}


def parse_env(raw: Any, shell: Mapping[str, str] | None = None) -> Env:
    """-Denv text or a YAML mapping -> {name: value}; ValueError saying what was expected."""
    shell = os.environ if shell is None else shell
    # (name, value, bare: the value is the shell's)
    if isinstance(raw, dict):
        items = [(k, v, v is None and isinstance(k, str) and NAME.fullmatch(k)) for k, v in raw.items()]
    elif isinstance(raw, str):
        items = [(k.strip(), v, not eq and NAME.fullmatch(k.strip()))
                 for k, eq, v in (item.partition("=") for item in _split_items(raw))]
    else:
        raise ValueError("expected K=V,K2=V2 (or a YAML mapping under env:)")
    if not items:
        raise ValueError("expected K=V,K2=V2, got nothing")
    pairs = [(name, _from_shell(name, shell) if bare else value) for name, value, bare in items]
    out = Env()
    out.from_shell = frozenset(name for name, _, bare in items if bare)
    for name, value in pairs:
        name, text = _check(name, value)
        if name in out:
            raise ValueError(f"{name} is given twice")
        out[name] = text
    if len(out) > MAX_VARS:
        raise ValueError(f"at most {MAX_VARS} variables, not {len(out)}")
    return out


def shown(env: Mapping[str, str]) -> str:
    """K=V, ... with secret-looking values masked: what paicli prints about them."""
    return ", ".join(f"{k}={MASK if looks_secret(k) else v}" for k, v in sorted(env.items()))


def apply_to_plan(plan, env: Mapping[str, str]) -> None:
    """Every role of the plan gets the job's variables (over what the adapter set;
    the launcher's PAI_* are set after both, at launch), and a note says which."""
    if not env:
        return
    for role in plan.roles:
        ours = _launcher_path(role.env.get("PYTHONPATH", ""))
        role.env.update(env)
        if "PYTHONPATH" in env:
            role.env.pop("PAI_INHERIT_PYTHONPATH", None)   # declared: it replaces the instance's own
            if ours:    # paitables' folder stays first (cluster/datasets.py)
                role.env["PYTHONPATH"] = ":".join(p for p in (ours, env["PYTHONPATH"]) if p)
    plan.notes.append(f"env: {shown(env)} (set on every instance)")


def _launcher_path(value: str) -> str:
    """The job folder's data/py entry that heads every role's PYTHONPATH, or ''."""
    first = value.split(":", 1)[0]
    return first if first.endswith("/data/py") else ""


def secret_values(plan) -> list[str]:
    """The values the master masks: those of secret-looking names in any role's env."""
    values = {v for role in plan.roles for k, v in role.env.items() if looks_secret(k) and len(v) >= MIN_MASKED}
    return sorted(values, key=len, reverse=True)


class Masker:
    """Replaces secret values in a byte stream with MASK, across chunk boundaries:
    a chunk's end that could be the start of a secret is held back until the next
    chunk (or `flush`) says whether it is one."""

    def __init__(self, secrets: list[str]):
        self.secrets = [s.encode() for s in secrets if len(s) >= MIN_MASKED]
        self.secrets.sort(key=len, reverse=True)
        self.held = b""

    def _hold_from(self, data: bytes) -> int:
        """Where the longest tail of `data` that is a proper prefix of a secret starts."""
        longest = max(len(s) for s in self.secrets)
        for start in range(max(0, len(data) - longest + 1), len(data)):
            tail = data[start:]
            if any(s.startswith(tail) for s in self.secrets):
                return start
        return len(data)

    def _replace(self, data: bytes) -> bytes:
        for secret in self.secrets:
            data = data.replace(secret, MASK.encode())
        return data

    def feed(self, data: bytes) -> bytes:
        if not self.secrets:
            return data
        data = self._replace(self.held + data)
        cut = self._hold_from(data)
        self.held = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        held, self.held = self.held, b""
        return self._replace(held)
