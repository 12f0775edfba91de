"""containerd's config.toml with a runtime `gpugate`, edited by its text, never rewritten.

Python 3.9's standard library writes no TOML, and a parse-and-dump would lose the operator's
comments, order and quoting. So install appends one marked block of tables (the runtime
`gpugate`: `runtime_type = "io.containerd.runc.v2"`, the runc options of the runtime it
wraps, `BinaryName` = gpugate's wrapper), and `--default` replaces the CRI plugin's
`default_runtime_name` line with a marked pair that keeps the original line verbatim;
uninstall takes out exactly those marked lines. Every result is parsed (tomllib) and compared
with the original's parse plus exactly the intended change: a file where tables cannot be
added that way (inline or dotted tables) is refused, not guessed at. Where the file is missing,
it is made from `containerd config default` and marked so, and uninstall removes it again
while the rest is as it was made.

CRI's tables: `plugins."io.containerd.grpc.v1.cri".containerd` in config version 2
(containerd 1.6, 1.7), `plugins."io.containerd.cri.v1.runtime".containerd` in version 3
(2.x).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpugate.compat import tomllib
from gpugate.config.toml_text import toml_value
from gpugate.errors import InstallError
from gpugate.host.safe_files import read_capped, untrusted, untrusted_text
from gpugate.untrusted import echo

CONFIG = Path("/etc/containerd/config.toml")
RUNTIME = "gpugate"
RUNC_V2 = "io.containerd.runc.v2"
CRI: dict[int, tuple[str, ...]] = {
    2: ("plugins", "io.containerd.grpc.v1.cri", "containerd"),
    3: ("plugins", "io.containerd.cri.v1.runtime", "containerd"),
}
BEGIN = "# >>> gpugate: runtime gpugate (gpugate install --containers; uninstall takes it out)"
NO_EOL = " [the file ended without a newline]"
END = "# <<< gpugate"
WAS = "# gpugate install --default replaced: "
WAS_NONE = "# gpugate install --default added the next line"
MADE = "# gpugate install --containers made this file from `containerd config default` (sha256:"
DEFAULT_KEY = re.compile(r"^(\s*)default_runtime_name\s*=")
BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_CONFIG = 1 << 20

Table = dict[str, object]


@dataclass(frozen=True)
class Wrapped:
    """The runtime whose options the gpugate runtime copies, and the program it ran."""

    name: str
    binary: str  # its options' BinaryName ("" where runc's own)


def read_text(path: Path) -> str | None:
    """The config's text; None where it is missing. Refused: another account may change it,
    not a regular file (a link, a FIFO), larger than 1 MiB, not UTF-8."""
    found = untrusted(path)
    if found is not None:
        raise InstallError(f"{path}: " + (untrusted_text(found) if found else "refused: untrusted"))
    try:
        raw = read_capped(path, MAX_CONFIG)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InstallError(f"{path}: cannot read it ({exc}); nothing changed") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InstallError(f"{path}: cannot read it ({exc}); nothing changed") from None


def parse(text: str, path: Path) -> Table:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(f"{path}: cannot be read as TOML ({exc}); nothing changed") from None


def cri_keys(data: Table, path: Path) -> tuple[str, ...]:
    version = data.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version not in CRI:
        raise InstallError(
            f"{path}: config version {echo(str(version))}: gpugate edits versions 2 (containerd "
            "1.6, 1.7) and 3 (2.x); `containerd config migrate` converts it; nothing changed"
        )
    return CRI[version]


def table_at(data: Table, keys: tuple[str, ...], *, make: bool = False) -> Table:
    """The table at keys ({} where missing; made there where make)."""
    here = data
    for key in keys:
        found = here.get(key)
        if not isinstance(found, dict):
            if not make:
                return {}
            found = here[key] = {}
        here = found
    return here


def strip(text: str, path: Path) -> str:
    """The text without gpugate's marks: its block taken out, a replaced line put back."""
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith(BEGIN):
            end = next(
                (n for n in range(index + 1, len(lines)) if lines[n].rstrip("\n") == END), None
            )
            if end is None:
                raise InstallError(
                    f"{path}: line {index + 1}: gpugate's block is opened and never closed "
                    f"(`{END}`); mend it by hand; nothing changed"
                )
            if NO_EOL in line and kept:
                kept[-1] = kept[-1][:-1] if kept[-1].endswith("\n") else kept[-1]
            index = end + 1
        elif line.startswith(WAS):
            kept.append(line[len(WAS) :])
            index += 2
        elif line.rstrip("\n") == WAS_NONE:
            index += 2
        else:
            kept.append(line)
            index += 1
    return "".join(kept)


def header_of(line: str) -> tuple[str, ...] | None:
    """A `[table]` line's keys, as TOML reads them (quotes, spaces); None for any other line."""
    stripped = line.strip()
    if not stripped.startswith("[") or stripped.startswith("[["):
        return None
    try:
        data: object = tomllib.loads(stripped)
    except tomllib.TOMLDecodeError:
        return None
    keys: list[str] = []
    while isinstance(data, dict) and len(data) == 1:
        key, data = next(iter(data.items()))
        keys.append(key)
    return tuple(keys)


def wrapped_runtime(cri: Table) -> tuple[Wrapped, Table]:
    """The CRI default runtime where it is runc's shim (NVIDIA's runtime is), else `runc`."""
    runtimes = table_at(cri, ("runtimes",))
    name = cri.get("default_runtime_name") or "runc"
    source = runtimes.get(str(name))
    if not isinstance(source, dict) or source.get("runtime_type", RUNC_V2) != RUNC_V2:
        name, source = "runc", runtimes.get("runc")
    source = source if isinstance(source, dict) else {}
    options = source.get("options")
    binary = options.get("BinaryName", "") if isinstance(options, dict) else ""
    return Wrapped(str(name), str(binary)), source


def runtime_table(source: Table, wrapper: str) -> Table:
    """The gpugate runtime: the wrapped one's settings and runc options, runc's shim, the
    wrapper as its binary."""
    table: Table = {"runtime_type": RUNC_V2}
    table.update({k: v for k, v in source.items() if k not in ("runtime_type", "options")})
    options = source.get("options")
    table["options"] = {**(options if isinstance(options, dict) else {}), "BinaryName": wrapper}
    return table


def dotted(keys: tuple[str, ...]) -> str:
    return ".".join(k if BARE_KEY.match(k) else toml_value(k) for k in keys)


def value_text(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{dotted((k,))} = {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    return toml_value(value)


def block(cri: tuple[str, ...], table: Table, *, default_table: bool, no_eol: bool) -> str:
    name = (*cri, "runtimes", RUNTIME)
    lines = ["\n" if no_eol else "", BEGIN + (NO_EOL if no_eol else "") + "\n"]
    if default_table:
        lines += [f"[{dotted(cri)}]\n", f'  default_runtime_name = "{RUNTIME}"\n']
    lines.append(f"[{dotted(name)}]\n")
    options = table.get("options")
    lines += [f"  {dotted((k,))} = {value_text(v)}\n" for k, v in table.items() if k != "options"]
    lines.append(f"[{dotted((*name, 'options'))}]\n")
    if isinstance(options, dict):
        lines += [f"  {dotted((k,))} = {value_text(v)}\n" for k, v in options.items()]
    return "".join(lines) + END + "\n"


def set_default(lines: list[str], cri: tuple[str, ...]) -> bool:
    """`default_runtime_name = "gpugate"` in the CRI table's own text, the line it replaces
    kept in a mark; False where the file has no `[...containerd]` header."""
    start = next((n for n, line in enumerate(lines) if header_of(line) == cri), None)
    if start is None:
        return False
    end = next((n for n in range(start + 1, len(lines)) if header_of(lines[n])), len(lines))
    indent = re.match(r"^\s*", lines[start]).group(0) + "  "  # type: ignore[union-attr]
    for number in range(start + 1, end):
        found = DEFAULT_KEY.match(lines[number])
        if found:
            original = lines[number] if lines[number].endswith("\n") else lines[number] + "\n"
            new = f'{found.group(1)}default_runtime_name = "{RUNTIME}"\n'
            lines[number : number + 1] = [WAS + original, new]
            return True
    lines[start + 1 : start + 1] = [
        WAS_NONE + "\n",
        f'{indent}default_runtime_name = "{RUNTIME}"\n',
    ]
    return True


def pruned(data: object) -> object:
    """Without empty tables (containerd reads a missing table and an empty one alike)."""
    if not isinstance(data, dict):
        return data
    kept = {k: pruned(v) for k, v in data.items()}
    return {k: v for k, v in kept.items() if v != {}}


def same_settings(text: str, expected: Table) -> bool:
    """text parses to expected (empty tables aside)."""
    try:
        return pruned(tomllib.loads(text)) == pruned(expected)
    except tomllib.TOMLDecodeError:  # a table the file defined inline or by dotted keys
        return False


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def installed(
    current: str | None,
    wrapper: str,
    *,
    path: Path,
    default: bool,
    default_config: Callable[[], str],
) -> tuple[str, Wrapped]:
    """The config with the runtime gpugate (the same text for a config that has it already,
    so a second install changes nothing), and the runtime it wraps."""
    base = default_config() if current is None else strip(current, path)
    data = parse(base, path)
    cri = cri_keys(data, path)
    cri_table = table_at(data, cri)
    if RUNTIME in table_at(cri_table, ("runtimes",)):
        raise InstallError(
            f"{path}: a runtime {RUNTIME} that gpugate install did not write is there; take "
            "it out first; nothing changed"
        )
    wrapped, source = wrapped_runtime(cri_table)
    table = runtime_table(source, wrapper)
    lines = base.splitlines(keepends=True)
    default_table = default and not set_default(lines, cri)
    body = "".join(lines)
    no_eol = bool(body) and not body.endswith("\n")
    text = body + block(cri, table, default_table=default_table, no_eol=no_eol)
    if current is None:
        text = f"{MADE}{digest(base)})\n{text}"
    expected = copy.deepcopy(data)
    table_at(expected, (*cri, "runtimes"), make=True)[RUNTIME] = table
    if default:
        table_at(expected, cri, make=True)["default_runtime_name"] = RUNTIME
    if not same_settings(text, expected):
        raise InstallError(
            f"{path}: adding {dotted(cri)} as a table would change other settings (inline "
            "or dotted tables there); add it by hand (docs/containers.md); nothing changed"
        )
    return text, wrapped


def uninstalled(current: str, *, path: Path) -> str | None:
    """The config as it was before install (None: remove it, install made it); the same text
    where gpugate's block is not there."""
    base = strip(current, path)
    data = parse(current, path)
    cri = cri_keys(data, path)
    before = parse(base, path)
    if table_at(before, cri).get("default_runtime_name") == RUNTIME:
        raise InstallError(
            f"{path}: default_runtime_name is {RUNTIME}, not set by gpugate install: set another "
            "first (containerd would not start its pods); nothing changed"
        )
    if base == current:
        return current
    expected = copy.deepcopy(data)
    table_at(expected, (*cri, "runtimes")).pop(RUNTIME, None)
    default = table_at(before, cri).get("default_runtime_name")
    cri_table = table_at(expected, cri)
    cri_table.pop("default_runtime_name", None)
    if default is not None:
        cri_table["default_runtime_name"] = default
    if pruned(before) != pruned(expected):
        raise InstallError(
            f"{path}: adding {dotted(cri)} as a table would change other settings (inline "
            "or dotted tables there); add it by hand (docs/containers.md); nothing changed"
        )
    first, _, rest = base.partition("\n")
    if first.startswith(MADE):
        return None if first == f"{MADE}{digest(rest)})" else rest
    return base


def nvidia_binaries(data: Table) -> list[str]:
    """Every runtime's BinaryName in the CRI tables (where NVIDIA's runtime is set up)."""
    found = []
    for cri in CRI.values():
        for runtime in table_at(data, (*cri, "runtimes")).values():
            options = runtime.get("options") if isinstance(runtime, dict) else None
            binary = options.get("BinaryName") if isinstance(options, dict) else None
            if isinstance(binary, str) and binary:
                found.append(binary)
    return found
