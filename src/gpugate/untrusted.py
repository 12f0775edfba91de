"""What processes say about themselves, made fit to show: escaped as journalctl shows it and
bounded. Any account may set a command line, comm, cgroup, container or file name: it reaches
gpugate's output only through this module, whose functions never raise on any str."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

MARK = "…"  # the one mark of a cut, in every output
NAMED = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r"}
LINE_CHARS = 8192  # one journal MESSAGE, STATUS= text or stderr line, at most
ECHO_MAX = 60  # characters of a value (or key) an error message repeats


class Kind(NamedTuple):
    """Bounds: of shown text (escaped, the mark included), of a journal field's exact bytes."""

    chars: int
    exact_bytes: int


COMMAND = Kind(200, 4096)
COMM = Kind(64, 64)  # the kernel keeps 15 bytes: 60 once each is escaped
CGROUP = Kind(200, 4096)  # also a unit named after a cgroup
CONTAINER = Kind(100, 256)  # a container's name
FILE = Kind(200, 4096)  # a file's name
STATE = Kind(200, 1024)  # what gpugate reads back from its state: a lease's unit, ...
# A Slurm node's drain reason (`scontrol update Reason=`): scontrol and slurmctld take any
# length, `sinfo -R` shows it on one line; gpugate keeps it to this.
REASON = Kind(250, 250)
KINDS = (COMMAND, COMM, CGROUP, CONTAINER, FILE, STATE)


def _escaped(char: str) -> str:
    if char.isprintable():
        return char
    if char in NAMED:
        return NAMED[char]
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the byte that was not UTF-8
        return f"\\x{code - 0xDC00:02x}"
    return "".join(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogatepass"))


def escape(text: str) -> str:
    """Return all of text escaped as journalctl shows it, unbounded (for text already bounded)."""
    return "".join(map(_escaped, text))


def truncate(text: str, chars: int) -> str:
    """Fit already escaped text in chars, ending in the mark (…) where it was cut."""
    return text if len(text) <= chars else text[: chars - 1] + MARK


def printable(value: str | None, kind: Kind) -> str:
    """Return value as an operator may see it (MESSAGE, STATUS=, stderr, `status`): escaped
    and cut to the kind's bound, never splitting an escape. At most kind.chars + 1
    characters of value are read, so any length costs the same."""
    return _printable(value or "", kind.chars)[0]


def _printable(value: str, chars: int) -> tuple[str, bool]:
    """Return value made printable within chars, and True where it was cut."""
    head = value[: chars + 1]
    if head.isprintable():
        return truncate(head, chars), len(head) > chars
    parts = [_escaped(char) for char in head]
    used = sum(map(len, parts))
    if used <= chars:  # then head is all of value
        return "".join(parts), False
    while parts and used + len(MARK) > chars:
        used -= len(parts.pop())
    return "".join(parts) + MARK, True


def printable_args(argv: Sequence[str], kind: Kind = COMMAND) -> tuple[list[str], bool]:
    """Return a command line as `status --json` lists it, and True where an argument was cut
    or left out. Each argument is made printable, and all of them together (with the spaces
    that would join them) fit in kind.chars."""
    result: list[str] = []
    left = kind.chars
    for arg in argv:
        room = left - (1 if result else 0)
        if room < 2:  # not even one character and the mark
            if result and not result[-1].endswith(MARK):
                result[-1] = result[-1][:-1] + MARK
            return result, True
        text, was_cut = _printable(arg, room)
        result.append(text)
        if was_cut:
            return result, True
        left = room - len(text)
    return result, False


def field_bytes(value: str | None, kind: Kind) -> str | bytes:
    """Return a structured journal field's value: its own bytes, unescaped, cut to
    kind.exact_bytes; a str where they are UTF-8, else bytes (the journal is binary safe)."""
    if not value:
        return ""
    head = value[: kind.exact_bytes]
    try:
        data = head.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that no byte stands for
        data = head.encode("utf-8", "surrogatepass")
    data = data[: kind.exact_bytes]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


def safe_line(text: str) -> str:
    """Return a sentence gpugate made, escaped and at most LINE_CHARS long: every output
    channel's last guard, so that no line can carry a newline or a terminal escape."""
    return printable(text, Kind(LINE_CHARS, LINE_CHARS))


def for_error(value: object, *, quote: bool = True, limit: int = ECHO_MAX) -> str:
    """Return value as an error repeats it: its repr (quote) or printable, cut to limit."""
    return truncate(repr(value), limit) if quote else printable(str(value), Kind(limit, limit))
