#!/bin/sh
# Boot a real systemd as PID 1 of private namespaces: the simulated GPU host.
# Driven by tests/simhost/sandbox.py (SimHost.boot); see tests/simhost/README.md.
#
#   boot.sh outer NAME CGROUP STAGE GPUS CONSOLE [LOWER]
#
# outer: moves itself into the (already created) cgroup CGROUP, so that the sandbox's cgroup
#        namespace is rooted there, and re-executes itself as "inner" under
#        unshare --pid --fork --mount --cgroup --net --uts --ipc --propagation private.
#        setpriv --pdeathsig KILL ties unshare to the launching process, and
#        unshare --kill-child=KILL ties the sandbox's PID 1 to unshare: if the launcher dies,
#        the whole sandbox dies with it.
# inner: PID 1 of the new PID namespace. Builds the root R as an overlay (lower: LOWER, by
#        default the host's /, else a root built by debootstrap; upper: a private tmpfs), mounts a private /dev, /proc, /sys (read-only), cgroup2, /run
#        and /tmp in R, copies STAGE/root/. (masks, files, libnvidia-ml, fake-nvml.conf) into R,
#        pivots into R and execs systemd.
#
# STAGE is a host directory prepared by sandbox.py: STAGE/root is copied into R, STAGE/scratch
# is the mount point of the scratch tmpfs (mounted in the private mount namespace only).
# CONSOLE is a pty slave on the host, bind-mounted on R/dev/console: systemd's status lines, and
# its log until journald is up (no /dev/kmsg here), go there.
set -eu

log() { printf 'boot.sh[%s]: %s\n' "$1" "$2" >&2; }

case "${1:-}" in
outer)
    [ "$#" -eq 6 ] || [ "$#" -eq 7 ] ||
        { log outer "usage: $0 outer NAME CGROUP STAGE GPUS CONSOLE [LOWER]"; exit 2; }
    name=$2 cgroup=$3
    log outer "moving pid $$ into $cgroup"
    echo $$ >"$cgroup/cgroup.procs"
    shift
    exec setpriv --pdeathsig KILL -- \
        unshare --pid --fork --kill-child=KILL --mount --cgroup --net --uts --ipc \
        --propagation private -- /bin/sh "$0" inner "$@"
    ;;
inner) ;;
*)
    log "?" "usage: $0 outer|inner NAME CGROUP STAGE GPUS CONSOLE [LOWER]"
    exit 2
    ;;
esac

name=$2 stage=$4 gpus=$5 console=$6 lower=${7:-/}
trap 'rc=$?; [ "$rc" -eq 0 ] || log inner "FAILED (exit $rc) at: ${step:-?}"' EXIT
step="sanity"
[ "$$" -eq 1 ] || { log inner "expected to be PID 1 of a new PID namespace, am $$"; exit 1; }

step="scratch tmpfs and overlay root"
scratch=$stage/scratch
mount -t tmpfs -o size=8g,mode=0755 "$name-scratch" "$scratch"
mkdir -p "$scratch/upper" "$scratch/work" "$scratch/root"
mount -t overlay "$name-root" -o "lowerdir=$lower,upperdir=$scratch/upper,workdir=$scratch/work" \
    "$scratch/root"
R=$scratch/root

step="private /dev"
mount -t tmpfs -o mode=0755,size=64m,nosuid "$name-dev" "$R/dev"
for d in null zero full random urandom tty; do
    : >"$R/dev/$d"
    mount --bind "/dev/$d" "$R/dev/$d"
done
: >"$R/dev/console"
mount --bind "$console" "$R/dev/console"
mkdir -m 0755 "$R/dev/pts"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 "$name-devpts" "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mkdir -m 1777 "$R/dev/shm"
mount -t tmpfs -o mode=1777,nosuid,nodev "$name-shm" "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"
ln -s /proc/self/fd/2 "$R/dev/stderr"
i=0
while [ "$i" -lt "$gpus" ]; do
    : >"$R/dev/nvidia$i"
    i=$((i + 1))
done
: >"$R/dev/nvidiactl"
: >"$R/dev/nvidia-uvm"
: >"$R/dev/nvidia-uvm-tools"
chmod 0666 "$R"/dev/nvidia*

step="proc, sys, cgroup2"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
# Host-global sysctls (fs.file-max, kernel.*, ...) must stay out of reach: PID 1 bumps some of
# them at start and systemd-sysctl/systemd-binfmt write them (both skip a read-only /proc/sys).
for p in sys sysrq-trigger; do
    [ -e "$R/proc/$p" ] || continue
    mount --bind "$R/proc/$p" "$R/proc/$p"
    mount -o remount,bind,ro,nosuid,nodev,noexec "$R/proc/$p"
done
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
mount -t cgroup2 -o rw,nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"

step="private /run and /tmp"
mount -t tmpfs -o mode=0755,nosuid,nodev,size=1g "$name-run" "$R/run"
mount -t tmpfs -o mode=1777,nosuid,nodev,size=2g "$name-tmp" "$R/tmp"

step="copy the staged files (masks, libnvidia-ml, fake-nvml.conf, files)"
# tar, not cp -a: existing directories (/, /etc, /tmp...) keep their own mode and owner.
(cd "$stage/root" && tar -cf - .) | tar -C "$R" -xpf - --no-overwrite-dir
if [ -e "$R/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" ]; then
    step="ldconfig"
    # The root's own ldconfig: its glibc's cache format (another release's root).
    chroot "$R" /sbin/ldconfig
fi

step="hostname"
echo "$name" >/proc/sys/kernel/hostname

step="pivot_root"
cd "$R"
mkdir -p .oldroot
pivot_root . .oldroot
cd /
umount -l /.oldroot
rmdir /.oldroot

# systemd brings lo up itself (loopback_setup); do it here too for anything that runs first.
ip link set lo up 2>/dev/null || true

step="exec systemd"
log inner "exec /lib/systemd/systemd"
trap - EXIT
exec env -i container="$name" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SYSTEMD_COLORS=0 \
    /lib/systemd/systemd --system --unit=multi-user.target --log-target=journal-or-kmsg \
    --log-level=info --show-status=yes
