# Sourced, not run: two network namespaces joined by a veth pair, the
# set-up tests/netns/two_hosts.sh and bench/netns_link.sh share.
#
#   two_namespaces TAG PREFIX SECONDS
#
# makes namespaces $a and $b, each held by a process sleeping SECONDS and
# entered with `in_ns PID CMD...`, joined by the veth ends $va (PREFIX.1, in
# $a) and $vb (PREFIX.2, in $b), loopbacks and ends up. Nothing is mounted
# (`ip netns add` mounts /run/netns, which outlives the caller in a chroot):
# the namespaces and the pair vanish with their holders, which an EXIT trap
# kills (it also removes "$log" where the caller set it). Exits 77 (skipped)
# where namespaces cannot be made: needs root and `ip` (iproute2).

skip() { echo "SKIPPED: $*"; exit 77; }
in_ns() { nsenter --net="/proc/$1/ns/net" "${@:2}"; }

two_namespaces() {
  local tag="$1" prefix="$2" seconds="$3"
  [[ "$(id -u)" == 0 ]] || skip "needs root to create network namespaces"
  command -v ip >/dev/null || skip "needs ip (Debian: iproute2)"
  unshare --net sleep "$seconds" & a=$!
  unshare --net sleep "$seconds" & b=$!
  trap '{ kill -9 "$a" "$b"; wait "$a" "$b"; } 2>/dev/null; [[ -n "${log:-}" ]] && rm -rf "$log"' EXIT
  sleep 0.2
  in_ns "$a" true 2>/dev/null || skip "cannot create or enter network namespaces here"
  va="${tag}va" vb="${tag}vb"
  ip link add "$va" type veth peer name "$vb" || skip "cannot create a veth pair"
  ip link set "$va" netns "$a" && ip link set "$vb" netns "$b" ||
    { ip link del "$va" 2>/dev/null; skip "cannot move a veth end into a namespace"; }
  in_ns "$a" ip addr add "$prefix.1/24" dev "$va"
  in_ns "$b" ip addr add "$prefix.2/24" dev "$vb"
  for ns in "$a" "$b"; do in_ns "$ns" ip link set lo up; done
  in_ns "$a" ip link set "$va" up
  in_ns "$b" ip link set "$vb" up
}
