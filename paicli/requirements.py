"""A job's own Python packages: `-Drequirements=file:///path/requirements.txt`, or YAML
`requirements:` as a file or a list of lines.

Parsed at submit into a normalised list of lines (the layer's digest is made of
them). pip's requirement syntax, plus the options that say where packages come
from (`--find-links DIR` travels with the job); anything that would reach outside
what travels (`-r`, `-c`, `-e PATH`, a local path) is refused with one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


MAX_LINES = 1000
# option -> takes a value
OPTIONS = {"--find-links": True, "-f": True, "--no-index": False, "--index-url": True, "-i": True,
           "--extra-index-url": True, "--pre": False, "--prefer-binary": False, "--only-binary": True}
CANONICAL = {"-f": "--find-links", "-i": "--index-url"}
# A requirement: a name (PEP 508), optional extras, then specifiers / markers / URL.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
REQUIREMENT = re.compile(NAME.pattern + r"(\[[A-Za-z0-9._, -]*\])?\s*([<>=!~;@ (].*)?")


def project_name(line: str) -> str:
    """A requirement line's project name, lower-cased ("" for an option)."""
    found = NAME.match(line)
    return found.group(0).lower() if found else ""


def _path(text: str, base: Path) -> Path:
    """A file:// URI or a path (relative to `base`), ~ expanded; ValueError if it cannot be."""
    text = text[len("file://"):] if text.startswith("file://") else text
    if "\x00" in text:
        raise ValueError("a path cannot contain a NUL character")
    try:
        path = Path(text).expanduser()
    except RuntimeError:   # `~name` of a user this machine does not know
        raise ValueError(f"{_shown(Path(text))}: no such user's home on this machine; give the full path") from None
    return path if path.is_absolute() else base / path


def _shown(path: Path) -> str:
    """A path for a one-line message (a newline in a name is shown escaped)."""
    text = str(path)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:   # a name too long, no permission
        return False


def _option(line: str, base: Path) -> str:
    match = re.match(r"(-[A-Za-z-]+)\s*=?\s*(.*)$", line)
    head, rest = (match.group(1), match.group(2).strip()) if match else (line, "")
    if head not in OPTIONS:
        raise ValueError(f"{line!r}: only these pip options may be given: "
                         f"{', '.join(o for o in OPTIONS if o.startswith('--'))} (no -r, -c or -e: "
                         "list the packages themselves)")
    name = CANONICAL.get(head, head)
    if not OPTIONS[head]:
        if rest:
            raise ValueError(f"{line!r}: {name} takes no value")
        return name
    if not rest:
        raise ValueError(f"{line!r}: {name} needs a value")
    local = rest.startswith("file://") or not re.match(r"^[a-z][a-z0-9+.-]*://", rest, re.I)
    if name == "--find-links" and local:
        folder = _path(rest, base)
        if not _is_dir(folder):
            raise ValueError(f"{line!r}: {_shown(folder)} is not a folder (--find-links takes a folder of wheels or an URL)")
        rest = str(folder.resolve())
    return f"{name} {rest}"


def normalise(lines: list[str], base: Path) -> list[str]:
    """Requirement lines without comments and blanks, options canonical, local
    --find-links folders absolute. ValueError naming the line."""
    out: list[str] = []
    for number, raw in enumerate(lines, 1):
        if not isinstance(raw, str):
            raise ValueError(f"item {number}: expected a requirement such as 'pandas==2.2', not {raw!r}")
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        if "\x00" in line:
            raise ValueError(f"line {number}: a NUL character")
        if line.startswith("-"):
            out.append(_option(line, base))
        elif REQUIREMENT.fullmatch(line):
            out.append(re.sub(r"\s+", " ", line))
        else:
            raise ValueError(f"line {number}: {line!r} is not a requirement (a package name such as "
                             "'pandas' or 'pandas==2.2'; local paths and -e do not travel to nodes)")
    if not any(not line.startswith("-") for line in out):
        raise ValueError("no package in it")
    if len(out) > MAX_LINES:
        raise ValueError(f"at most {MAX_LINES} lines, not {len(out)}")
    return out


def parse_requirements(raw: Any, base: Path) -> list[str]:
    """A file (file:// URI or path, relative to `base`) or a YAML list -> normalised lines."""
    if isinstance(raw, list):
        return normalise(raw, base)
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("expected file:///path/requirements.txt (or a YAML list of requirements)")
    text = raw.strip()
    path = _path(text, base)
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{_shown(path)} does not exist; check the path (file:// URIs take an absolute path)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"cannot read {_shown(path)}: {getattr(err, 'strerror', None) or err}") from None
    return normalise(content.splitlines(), path.parent)


def find_links(lines: list[str]) -> list[str]:
    """The local folders the lines name with --find-links."""
    return [line.split(" ", 1)[1] for line in lines
            if line.startswith("--find-links ") and os.path.isabs(line.split(" ", 1)[1])]
