#!/usr/bin/env bash
# Install the Debian packages the tests need that are not there already: chromium (the browser
# tests' browser), caddy (the proxy of `kvviz app --workers N`) and redis-server (the class
# store's Redis tests), waiting out an apt/dpkg lock that another install holds instead of
# failing on it.
#
# apt-get gets -o DPkg::Lock::Timeout (it then waits for the dpkg lock itself). Not every lock
# honours that option (apt-get update's lists lock, older apt), so a run that still ends in
# "Could not get lock" is retried, with a line saying so, until KVVIZ_APT_LOCK_TIMEOUT
# seconds (600) have passed. Any other failure ends the script at once.
# Overridable for tests: KVVIZ_CHROMIUM, KVVIZ_CADDY, KVVIZ_REDIS (the programs looked for),
# KVVIZ_APT (the apt command, used as given: no sudo), KVVIZ_APT_LOCKS (the lock files named
# in the waiting line).
set -euo pipefail

MISSING=()
[ -x "${KVVIZ_CHROMIUM:-/usr/bin/chromium}" ] || MISSING+=(chromium)
command -v "${KVVIZ_CADDY:-caddy}" >/dev/null || MISSING+=(caddy)
command -v "${KVVIZ_REDIS:-redis-server}" >/dev/null || MISSING+=(redis-server)
[ "${#MISSING[@]}" -eq 0 ] && exit 0

TIMEOUT=${KVVIZ_APT_LOCK_TIMEOUT:-600}
LOCKS=${KVVIZ_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/apt/lists/lock}
if [ -n "${KVVIZ_APT:-}" ]; then
  read -r -a APT <<< "$KVVIZ_APT"
elif [ "$(id -u)" -eq 0 ]; then
  APT=(apt-get)
else
  APT=(sudo apt-get)
fi

# Say who holds a lock before apt starts waiting on it (fuser, from psmisc, sees any process
# with it open; without fuser the retry loop below still says it is waiting).
say_if_locked() {
  local lock pids
  command -v fuser >/dev/null || return 0
  for lock in $LOCKS; do
    pids=$(fuser "$lock" 2>/dev/null | tr -s ' ' || true)
    if [ -n "${pids// /}" ]; then
      echo "apt_deps: $lock is held by process${pids}; waiting for it (up to ${TIMEOUT} s)"
    fi
  done
}

apt_run() {  # apt_run ARGS...: run apt, retrying while it fails on a lock, until the deadline
  local deadline=$((SECONDS + TIMEOUT)) out rc
  out=$(mktemp)
  while :; do
    say_if_locked
    rc=0
    DEBIAN_FRONTEND=noninteractive "${APT[@]}" -o DPkg::Lock::Timeout="$TIMEOUT" "$@" 2>&1 \
      | tee "$out" || rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then rm -f "$out"; return 0; fi
    if ! grep -qiE "could not get lock|unable to (acquire|lock)" "$out"; then
      rm -f "$out"; return "$rc"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "apt_deps: the apt lock was still held after ${TIMEOUT} s; giving up" >&2
      rm -f "$out"; return "$rc"
    fi
    echo "apt_deps: apt is locked by another install; waiting and trying again"
    sleep 2
  done
}

apt_run update -qq
apt_run install -y -qq "${MISSING[@]}"
