#!/bin/bash
# A stand-in for the `enroot` CLI with enroot's defaults (enroot is in no package registry; CI runs this, and
# tests/test_enroot_runtime.py runs the same tests against a real enroot when TRAINBOX_REAL_ENROOT names one).
# Follows NVIDIA/enroot 4.1.2 (src/runtime.sh, bin/enroot-switchroot.c, conf/): needs root, like enroot run by root
# without ENROOT_ALLOW_SUPERUSER, it runs the container in a new user namespace where the caller is uid 0 mapped to
# itself only ("0 0 1"), and a private mount namespace.
#   create [--name N] [--force] X.sqsh   unsquashfs into $ENROOT_DATA_PATH/N
#   remove [--force] N                   rm -rf
#   start [--rw] [-m|--mount SPEC]... [-e|--env K[=V]]... N [ARGS]
#         mounts of conf/mounts/10-system.fstab (proc, sys, dev, tmpfs /tmp /var/run /var/lock, /dev/shm) and
#         20-config.fstab (hosts, hostname, resolv.conf), the image's /etc/fstab (its VOLUMEs: a writable bind of the
#         rootfs folder onto itself), then --mount SRC:DST[:...]; NO home mount (ENROOT_MOUNT_HOME=no); the rootfs
#         remounted read-only (ENROOT_ROOTFS_WRITABLE=no; --rw keeps it writable); the environment cleared and made of
#         the image's /etc/environment + TERM + --env (switchroot's clearenv), HOME/USER/SHELL from the container's
#         passwd (login), then a login sh runs /etc/rc ARGS, i.e. the image ENTRYPOINT with ARGS.
#   exec [-e|--env K[=V]]... PID CMD...   like `enroot exec` (and pyxis for each task): join the running container's
#         namespaces and root, its environment + --env, run CMD directly (no /etc/rc: the ENTRYPOINT is skipped).
set -euo pipefail
die() { echo "enroot (stand-in): $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "the stand-in needs root (it builds the namespaces with unshare/mount)"
cmd="${1:-}"; shift || true

envs=()
take_env() {  # --env K (value from the caller) or K=V, as enroot takes them
    if [[ "$1" == *=* ]]; then envs+=("$1"); else envs+=("$1=${!1-}"); fi
}

case "$cmd" in
create)
    data="${ENROOT_DATA_PATH:?set ENROOT_DATA_PATH}"; mkdir -p "$data"
    name=; force=
    while [ $# -gt 1 ]; do case "$1" in
        -n|--name) name="$2"; shift 2 ;; -f|--force) force=y; shift ;; *) break ;; esac; done
    sqsh="$1"; name="${name:-$(basename "${sqsh%.sqsh}")}"
    if [ -e "$data/$name" ]; then
        [ -n "$force" ] || die "File already exists: $data/$name"
        rm -rf "${data:?}/$name"
    fi
    unsquashfs -q -n -d "$data/$name" "$sqsh" > /dev/null ;;
remove)
    data="${ENROOT_DATA_PATH:?set ENROOT_DATA_PATH}"
    [[ "${1:-}" == -f || "${1:-}" == --force ]] && shift
    rm -rf "${data:?}/$1" ;;
start)
    data="${ENROOT_DATA_PATH:?set ENROOT_DATA_PATH}"
    mounts=(); rw=
    while [ $# -gt 0 ]; do case "$1" in
        -m|--mount) mounts+=("$2"); shift 2 ;;
        -e|--env) take_env "$2"; shift 2 ;;
        -w|--rw) rw=y; shift ;;
        *) break ;; esac; done
    root="$data/$1"; shift
    [ -d "$root" ] || die "No such file or directory: $root"
    mapfile -t ienv < <(grep -v '^#' "$root/etc/environment" | grep '=' || true)
    # login (enroot-switchroot sys_login): HOME/SHELL/USER from the container's passwd entry of the uid
    IFS=: read -r user _ _ _ _ home shell < <(awk -F: '$3 == 0' "$root/etc/passwd" | head -n 1)
    exec unshare --user --map-root-user --mount bash -c '
        set -euo pipefail
        root="$1" rw="$2" nm="$3"; shift 3; mounts=("${@:1:$nm}"); shift "$nm"
        mount --make-rprivate /
        mount --bind "$root" "$root"
        for d in proc sys dev; do mkdir -p "$root/$d"; mount --rbind "/$d" "$root/$d"; done
        for d in tmp var/run var/lock; do  # Debian: /var/run -> /run, /var/lock -> /run/lock (inside the rootfs)
            p="$root/$d"; l=$(readlink "$p" || :)
            case "$l" in "") ;; /*) p="$root$l" ;; *) p="$(dirname "$p")/$l" ;; esac
            mkdir -p "$p"; mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$p"
        done
        for f in hosts hostname resolv.conf; do touch "$root/etc/$f"; mount --bind -o ro "/etc/$f" "$root/etc/$f"; done
        # the image VOLUMEs (/etc/fstab lines "${ENROOT_ROOTFS}/dir /dir none x-create=dir,bind,rw,...")
        while read -r src dst _; do
            [ -n "$src" ] && [ "${src:0:1}" != "#" ] || continue
            src="${src//\$\{ENROOT_ROOTFS\}/$root}"; mkdir -p "$src" "$root$dst"; mount --bind "$src" "$root$dst"
        done < "$root/etc/fstab"
        for m in ${mounts[@]+"${mounts[@]}"}; do
            IFS=: read -r src dst _ opts <<< "$m"; dst="${dst:-$src}"
            mkdir -p "$root$dst"; mount --bind "$src" "$root$dst"
            [[ ",$opts," == *,ro,* ]] && mount -o remount,bind,ro "$root$dst"
        done
        [ -n "$rw" ] || mount -o remount,bind,ro "$root"
        exec "$@"' _ "$root" "$rw" "${#mounts[@]}" ${mounts[@]+"${mounts[@]}"} \
        env -i HOME="$home" USER="$user" LOGNAME="$user" SHELL="$shell" \
        ${ienv[@]+"${ienv[@]}"} ${TERM:+TERM="$TERM"} ${envs[@]+"${envs[@]}"} \
        chroot "$root" /bin/sh -l /etc/rc "$@" ;;
exec)
    while [ $# -gt 0 ]; do case "$1" in
        -e|--env) take_env "$2"; shift 2 ;;
        *) break ;; esac; done
    pid="$1"; shift
    [ -r "/proc/$pid/environ" ] || die "No such process: $pid"
    mapfile -d '' -t penv < "/proc/$pid/environ"
    exec nsenter --target "$pid" --user --mount --root --wd \
        env -i ${penv[@]+"${penv[@]}"} ${envs[@]+"${envs[@]}"} "$@" ;;
*) die "$cmd not supported (create, remove, start, exec)" ;;
esac
