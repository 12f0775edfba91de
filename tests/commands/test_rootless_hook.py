"""Issue 34, rule 2: a hook (or the runc wrapper) that is not the host's root gates nothing
and breaks nothing. "Not the host's root" is the kernel's word: euid, then the user
namespace's uid_map, then PID 1's namespace where it can be read (host/oci.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import ExitCode
from gpugate.front.commands import oci_hook, oci_runtime
from gpugate.host.oci import not_host_root
from gpugate.host.wrapped_runtime import RUNC, Wrapped
from gpugate.report import journal

GPU_SPEC = {"linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}}
A_ID = "a" * 64


def fake_proc(tmp_path: Path, uid_map: str | None, *, same_ns: bool | None = None) -> str:
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "1" / "ns").mkdir(parents=True)
    if uid_map is not None:
        (proc / "self" / "uid_map").write_text(uid_map)
    if same_ns is not None:
        (proc / "self" / "ns" / "user").write_text("mine")
        if same_ns:
            (proc / "1" / "ns" / "user").symlink_to(proc / "self" / "ns" / "user")
        else:
            (proc / "1" / "ns" / "user").write_text("init's")
    return str(proc)


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)


@pytest.mark.parametrize(
    "uid_map",
    [
        "         0          0 4294967295\n",  # as the kernel writes the initial namespace's
        "0 0 4294967295",
        "\t0\t0\t4294967295\n\n",
    ],
)
@pytest.mark.usefixtures("as_root")
def test_the_initial_namespace_is_the_hosts_root(tmp_path: Path, uid_map: str) -> None:
    assert not_host_root(fake_proc(tmp_path, uid_map)) is None


@pytest.mark.parametrize(
    "uid_map",
    [
        "         0       1000          1\n",  # unshare --user --map-root-user by alice
        "0 1000 1\n1 100000 65536\n",  # rootless podman (newuidmap, /etc/subuid)
        "0 100000 65536\n",  # docker userns-remap
        "0 0 1\n",  # root's own unshare --map-root-user: still not the initial namespace
        "0 0 4294967294\n",  # all but one uid
        "1 1 4294967295\n",
        "",  # a namespace whose map is not written yet
        "0 0 4294967295\n1 1 1\n",  # not the kernel's single line
    ],
)
@pytest.mark.usefixtures("as_root")
def test_a_user_namespace_is_not_the_hosts_root(tmp_path: Path, uid_map: str) -> None:
    why = not_host_root(fake_proc(tmp_path, uid_map))
    assert why is not None


@pytest.mark.usefixtures("as_root")
def test_a_full_map_in_another_namespace_than_pid_1s_is_not_the_hosts_root(
    tmp_path: Path,
) -> None:
    proc = fake_proc(tmp_path, "0 0 4294967295\n", same_ns=False)
    assert not_host_root(proc) is not None
    proc_same = fake_proc(tmp_path / "same", "0 0 4294967295\n", same_ns=True)
    assert not_host_root(proc_same) is None


@pytest.mark.usefixtures("as_root")
def test_an_unreadable_uid_map_leaves_the_euid_to_decide(tmp_path: Path) -> None:
    assert not_host_root(fake_proc(tmp_path, None)) is None


def test_an_euid_that_is_not_0_is_not_the_hosts_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert not_host_root(fake_proc(tmp_path, "0 0 4294967295")) == "euid 1000"


def in_user_namespace(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """argv run as uid 0 of a user namespace this test makes (`unshare --user
    --map-root-user`), as a rootless runtime runs its hooks."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux unshare to make a user namespace")
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a user namespace here: {probe.stderr.decode().strip()}")
    return subprocess.run(
        [unshare, "--user", "--map-root-user", *argv],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_a_process_in_a_user_namespace_is_not_the_hosts_root() -> None:
    code = "from gpugate.host.oci import not_host_root as n; print(n())"
    done = in_user_namespace(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() != "None"  # a reason: not the host's root


def gpu_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_text(json.dumps(GPU_SPEC))
    return bundle


@pytest.mark.parametrize("stage", ["createRuntime", "prestart", "poststop", "poststart"])
def test_the_hook_in_a_user_namespace_lets_a_gpu_container_start(
    tmp_path: Path, stage: str
) -> None:
    """The rootless podman case: the hook runs as uid 0 of its user's namespace, where
    /run/gpugate is nobody's. It exits 0, says nothing on stderr, writes nothing."""
    bundle = gpu_bundle(tmp_path)
    before = (bundle / "config.json").read_bytes()
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": str(bundle)}).encode()
    code = "import sys; sys.argv[1:] = sys.argv[2:]; from gpugate.front.entry import run; run()"
    done = in_user_namespace(sys.executable, "-c", code, "-", "oci-hook", stage, stdin=raw)
    assert (done.returncode, done.stderr) == (0, b"")
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json"]
    assert (bundle / "config.json").read_bytes() == before


@pytest.mark.parametrize(
    "stdin", [b"{not json", b"", b'{"id": "x"}', json.dumps({"id": A_ID, "bundle": "/gone"})]
)
def test_the_hook_in_a_user_namespace_breaks_nothing_on_bad_input(stdin: object) -> None:
    raw = stdin if isinstance(stdin, bytes) else str(stdin).encode()
    code = "import sys; sys.argv[1:] = sys.argv[2:]; from gpugate.front.entry import run; run()"
    done = in_user_namespace(
        sys.executable, "-c", code, "-", "oci-hook", "createRuntime", stdin=raw
    )
    assert (done.returncode, done.stderr) == (0, b"")


class Sent:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, journal.FieldValue]]] = []

    def send(self, message: str, fields: dict[str, journal.FieldValue]) -> None:
        self.entries.append((message, fields))


def run_not_gated(
    monkeypatch: pytest.MonkeyPatch, stage: str, state: bytes, why: str = "euid 1000"
) -> tuple[int, Sent]:
    sent = Sent()
    monkeypatch.setattr(journal.SystemdJournal, "send", lambda _self, m, f: sent.send(m, f))
    monkeypatch.setattr(oci_hook, "read_stdin_bounded", lambda: state)
    monkeypatch.setattr(oci_hook, "not_host_root", lambda: why)
    return oci_hook.main([stage]), sent


@pytest.mark.message
@pytest.mark.parametrize("stage", ["createRuntime", "prestart"])
def test_one_journal_line_for_a_rootless_gpu_containers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    bundle = gpu_bundle(tmp_path)
    raw = json.dumps({"id": A_ID, "pid": 7, "bundle": str(bundle)}).encode()
    code, sent = run_not_gated(monkeypatch, stage, raw, "user namespace, uid_map 0 1000 1")
    assert code == ExitCode.OK
    ((message, fields),) = sent.entries
    assert fields["GPUGATE_REASON"] == oci_hook.NOT_ROOT
    assert fields["GPUGATE_OCI_CONTAINER"] == A_ID
    assert fields["GPUGATE_EVENT"] == "warning"
    assert "uid_map 0 1000 1" in message


def test_no_journal_line_without_gpus_or_after_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "plain"
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_text(json.dumps({"process": {"env": ["A=1"]}}))
    raw = json.dumps({"id": A_ID, "bundle": str(bundle)}).encode()
    assert run_not_gated(monkeypatch, "createRuntime", raw)[1].entries == []
    gpu = json.dumps({"id": A_ID, "bundle": str(gpu_bundle(tmp_path))}).encode()
    for stage in ("poststop", "startContainer"):
        code, sent = run_not_gated(monkeypatch, stage, gpu)
        assert (code, sent.entries) == (ExitCode.OK, [])


class Execed(Exception):
    pass


def run_wrapper(monkeypatch: pytest.MonkeyPatch, argv: list[str], why: str | None) -> list[str]:
    calls: list[list[str]] = []

    def execve(path: str, args: list[str], environment: dict[str, str]) -> None:
        calls.append(args)
        raise Execed(path)

    monkeypatch.setattr(oci_runtime, "read_record", lambda: RUNC)
    monkeypatch.setattr(
        oci_runtime, "choose", lambda recorded, environ: Wrapped(RUNC, "/usr/bin/runc")
    )
    monkeypatch.setattr(oci_runtime, "not_host_root", lambda: why)
    monkeypatch.setattr(oci_runtime.os, "execve", execve)
    with pytest.raises(Execed):
        oci_runtime.main(argv)
    (args,) = calls
    return args


@pytest.mark.parametrize("command", ["create", "run"])
def test_the_runc_wrapper_of_a_rootless_runtime_execs_runc_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    bundle = gpu_bundle(tmp_path)
    before = (bundle / "config.json").read_bytes()
    argv = ["--root", "/run/user/1000/runc", command, "--bundle", str(bundle), A_ID]
    args = run_wrapper(monkeypatch, argv, "user namespace, uid_map 0 1000 1")
    assert args == ["/usr/bin/runc", *argv]
    assert (bundle / "config.json").read_bytes() == before
    # The host's root: the same create gets gpugate's hooks (the contrast).
    run_wrapper(monkeypatch, argv, None)
    hooks = json.loads((bundle / "config.json").read_text())["hooks"]
    assert set(hooks) == {"createRuntime", "poststop"}
