#!/bin/sh
# Start or stop a private Docker daemon for the image tests and `make image`.
#   eval "$(ci/dockerd.sh start)"   # prints: export DOCKER_HOST=unix://...
#   ci/dockerd.sh stop
#   ci/dockerd.sh dir               # prints the state folder it uses
# `e2 image build` (make image) runs `start` itself when no engine answers.
# start prints to stderr only when it started a daemon (not when one was up).
# State lives under $E2_DOCKERD_DIR (default $XDG_CACHE_HOME/vllm-e2/dockerd, the
# dockerd/ of e2's default cache; e2 passes its cache's folder) so
# images (the CPU base, the busybox stand-in) survive between CI runs. No
# iptables, no bridge: builds run with network_mode=none and the e2e test
# uses --network host. Needs root (or rootless dockerd set up separately).
set -eu
dir="${E2_DOCKERD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-e2/dockerd}"
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

start() {
    if running; then echo "export DOCKER_HOST=unix://$sock"; return 0; fi
    command -v dockerd >/dev/null || { echo "ci/dockerd.sh: no dockerd binary (apt-get install docker.io)" >&2; exit 1; }
    mkdir -p "$dir/data" "$dir/exec"
    for driver in overlay2 vfs; do
        dockerd --storage-driver="$driver" --iptables=false --ip6tables=false --bridge=none \
            --ip-masq=false --data-root "$dir/data" --exec-root "$dir/exec" \
            -H "unix://$sock" -p "$pidfile" >"$dir/dockerd.log" 2>&1 &
        n=0
        while [ $n -lt 60 ]; do
            if DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 \
               || python3 -c "import docker,sys; docker.DockerClient(base_url='unix://$sock').ping()" 2>/dev/null; then
                echo "ci/dockerd.sh: started dockerd $! ($driver, data root $dir/data, log $dir/dockerd.log)" >&2
                echo "export DOCKER_HOST=unix://$sock"; return 0
            fi
            kill -0 $! 2>/dev/null || break   # exited: try the next storage driver
            n=$((n + 1)); sleep 0.5
        done
        kill $! 2>/dev/null || true; wait $! 2>/dev/null || true
        echo "ci/dockerd.sh: dockerd with $driver did not come up (log: $dir/dockerd.log)" >&2
    done
    exit 1
}

stop() {
    running || { rm -f "$pidfile"; return 0; }
    pid="$(cat "$pidfile")"
    kill "$pid"
    n=0; while kill -0 "$pid" 2>/dev/null && [ $n -lt 60 ]; do n=$((n + 1)); sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { echo "ci/dockerd.sh: dockerd $pid still running" >&2; exit 1; }
    # dockerd leaves its default network namespace mounted: release it so $dir can be removed
    for ns in "$dir"/exec/netns/*; do
        if [ -e "$ns" ]; then umount "$ns" 2>/dev/null || true; fi
    done
    rm -f "$pidfile"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    dir) echo "$dir" ;;
    *) echo "usage: $0 start|stop|dir" >&2; exit 2 ;;
esac
