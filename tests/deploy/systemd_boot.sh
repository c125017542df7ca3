#!/bin/bash
# Boot systemd as PID 1 of a test host (tests/deploy/systemd_host.py), the way Molecule / systemd-nspawn
# boot a container: new PID, mount, cgroup, UTS and IPC namespaces inside the host's network namespace.
#
#   systemd_boot.sh outer CGROUP NETNS LAB_ROOT UNITS HOME_TREES [KEEP...]   (root namespace, run by systemd_host.py)
#   systemd_boot.sh inner LAB_ROOT UNITS HOME_TREES [KEEP...]                (PID 1 of the new namespaces; execs systemd)
#
# KEEP: more folders under /tmp or /var/tmp carried into the private ones at the same path (the checkout, when
# it lies there). HOME_TREES: folders under /root, colon-separated (may be empty), that the host's /root shows
# read-only to every user: the interpreter's venv and base Python, where the machine keeps them under its /root
# (mode 700), so the deployment's service user can run them as it would from /opt or /usr on a real host.
#
# The booted systemd must never act on the machine: it sees its own tmpfs /tmp, /var/tmp, /run,
# /etc/systemd/system and journal (the lab root is moved into the private /tmp at the same path), its own copy
# of /etc (the deploy creates its service user in that passwd and group, not the machine's), only
# the units in UNITS (every *.wants directory and generator of the distribution is hidden, the rest
# masked), a read-only /sys and /proc/sys (no sysctl, udev or module loading reaches the kernel), and a
# cgroup2 tree rooted at CGROUP, a cgroup made for this host (no other hierarchy is mounted inside).
set -euo pipefail

case "$1" in
outer)
    cgroup=$2 netns=$3 lab=$4 units=$5 home_trees=$6
    shift 6
    echo $$ >"$cgroup/cgroup.procs"  # the cgroup namespace made next is rooted here
    exec ip netns exec "$netns" unshare --pid --fork --mount --cgroup --uts --ipc --propagation private \
        bash "$0" inner "$lab" "$units" "$home_trees" "$@"
    ;;
inner)
    lab=$2 units=$3 home_trees=$4
    shift 4
    keep=("$@")
    ;;
*)
    echo "usage: $0 outer CGROUP NETNS LAB_ROOT UNITS HOME_TREES [KEEP...]" >&2
    exit 2
    ;;
esac

umask 022
mount --make-rprivate /
# private /run; the lab root (under the machine's /tmp) waits there while /tmp is replaced
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run

# private /etc: a copy of the machine's (users and groups the deploy creates stay in this host)
mkdir /run/lab-etc
mount -t tmpfs -o mode=755 tmpfs /run/lab-etc
cp -a /etc/. /run/lab-etc/
mount --move /run/lab-etc /etc
rmdir /run/lab-etc

# /root: a tmpfs any user may enter, showing only the interpreter's trees (read-only) of the machine's /root
if [ -n "$home_trees" ]; then
    IFS=: read -ra trees <<<"$home_trees"
    for i in "${!trees[@]}"; do
        mkdir -p "/run/lab-home/$i"
        mount --bind "${trees[$i]}" "/run/lab-home/$i"
        mount -o remount,bind,ro "/run/lab-home/$i"
    done
    mount -t tmpfs -o mode=755 tmpfs /root
    for i in "${!trees[@]}"; do
        mkdir -p "${trees[$i]}"
        mount --move "/run/lab-home/$i" "${trees[$i]}"
        rmdir "/run/lab-home/$i"
    done
    rmdir /run/lab-home
fi
mkdir /run/lab-root
mount --bind "$lab" /run/lab-root
for i in "${!keep[@]}"; do
    mkdir -p "/run/lab-keep/$i"
    mount --bind "${keep[$i]}" "/run/lab-keep/$i"
done
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp
mkdir -p "$lab"
mount --move /run/lab-root "$lab"
rmdir /run/lab-root
for i in "${!keep[@]}"; do
    mkdir -p "${keep[$i]}"
    mount --move "/run/lab-keep/$i" "${keep[$i]}"
    rmdir "/run/lab-keep/$i"
done
if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=2755 tmpfs /var/log/journal; fi

# units: the lab's own, nothing the distribution enables
mount -t tmpfs -o mode=755 tmpfs /etc/systemd/system
cp -a "$units"/. /etc/systemd/system/
for d in /usr/lib/systemd/system/*.wants /usr/lib/systemd/system/*.requires /usr/lib/systemd/system-generators \
         /usr/local/lib/systemd/system-generators /etc/systemd/system-generators; do
    if [ -d "$d" ]; then mount -t tmpfs -o ro,mode=755 tmpfs "$d"; fi
done

# kernel interfaces: this PID namespace's /proc, read-only /proc/sys and /sys, our cgroup subtree
mount -t proc -o nosuid,nodev,noexec proc /proc
for p in /proc/sys /proc/sysrq-trigger; do
    if [ ! -e "$p" ]; then continue; fi
    mount --bind "$p" "$p"
    mount -o remount,bind,ro "$p"
done
umount -R /sys/fs/cgroup 2>/dev/null || true
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup  # shows the cgroup namespace's root only
mount -o remount,bind,ro /sys

export container=tilepd-lab
# the manager's own lines ("Main process exited", "Scheduled restart job") go to the host's journal, as on
# a real host (`journalctl -u UNIT`); before journald runs, and should it fail, to this script's output
exec /usr/bin/systemd --system --unit=multi-user.target --log-target=journal --log-level=info
