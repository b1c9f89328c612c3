#!/usr/bin/env bash
# Two nodes on one machine joined by a network link of a chosen rate:
# network namespaces joined by a veth pair (10.231.9.1 and 10.231.9.2, a
# private range), each end shaped by a token bucket (tc tbf) to RATE, one
# `colossalai run --nnodes 2` per node with one rank each. Runs BENCH with
# its arguments on both; rank 0's output (on node 0) is printed. For what a
# step costs across nodes (fp8_communication, bytes on the wire) on a
# machine that has no second host.
#
#   bench/netns_link.sh RATE CLI BENCH [BENCH ARGS...]
#   e.g. bench/netns_link.sh 1gbit build/colossalai build/bench/bench_ddp_step --fp8 1
#
# Needs root, `ip` and `tc` (iproute2); exits 77 where namespaces cannot be
# made.
set -uo pipefail
rate="$1"
cli="$2"
shift 2
tag="cbl$$"
log="$(mktemp -d)"

skip() { echo "SKIPPED: $*"; exit 77; }
[[ "$(id -u)" == 0 ]] || skip "needs root to create network namespaces"
command -v ip >/dev/null && command -v tc >/dev/null || skip "needs ip and tc (Debian: iproute2)"
# Namespaces held by sleeping processes, entered through /proc/PID/ns/net
# (nothing mounted); they and the veth pair vanish with the holders.
unshare --net sleep 100000 & a=$!
unshare --net sleep 100000 & b=$!
cleanup() {
  { kill -9 "$a" "$b"; wait "$a" "$b"; } 2>/dev/null
  rm -rf "$log"
}
trap cleanup EXIT
in_ns() { nsenter --net="/proc/$1/ns/net" "${@:2}"; }
sleep 0.2
in_ns "$a" true 2>/dev/null || skip "cannot create or enter network namespaces here"
ip link add "${tag}a" type veth peer name "${tag}b" || skip "cannot create a veth pair"
ip link set "${tag}a" netns "$a" && ip link set "${tag}b" netns "$b" ||
  { ip link del "${tag}a" 2>/dev/null; skip "cannot move a veth end into a namespace"; }
in_ns "$a" ip addr add 10.231.9.1/24 dev "${tag}a"
in_ns "$b" ip addr add 10.231.9.2/24 dev "${tag}b"
for ns in "$a" "$b"; do in_ns "$ns" ip link set lo up; done
in_ns "$a" ip link set "${tag}a" up
in_ns "$b" ip link set "${tag}b" up
# Each direction is limited where it leaves: a 1 MiB bucket, packets
# waiting at most 50 ms.
for end in "$a:${tag}a" "$b:${tag}b"; do
  in_ns "${end%%:*}" tc qdisc add dev "${end#*:}" root tbf rate "$rate" \
    burst 1mbit latency 50ms || skip "tc cannot shape the link"
done

node() {
  in_ns "$2" env GLOO_SOCKET_IFNAME="$3" \
    "$cli" run --nnodes 2 --node_rank "$1" --nproc_per_node 1 \
      --master_addr 10.231.9.1 --master_port 29651 "${@:4}" >"$log/node.$1" 2>&1
}
# Bytes each end has sent: what crossed the link, headers included.
sent() {
  in_ns "$1" ip -s -j link show dev "$2" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])'
}
a0=$(sent "$a" "${tag}a"); b0=$(sent "$b" "${tag}b")
node 0 "$a" "${tag}a" "${@}" & p0=$!
node 1 "$b" "${tag}b" "${@}" & p1=$!
wait $p0; r0=$?
wait $p1; r1=$?
cat "$log/node.0"
echo "link: $rate; bytes sent by node 0: $(( $(sent "$a" "${tag}a") - a0 )), by node 1: $(( $(sent "$b" "${tag}b") - b0 ))"
if [[ $r0 != 0 || $r1 != 0 ]]; then
  echo "FAILED: launchers exited with $r0 and $r1; node 1's output:"
  tail -n 30 "$log/node.1"
  exit 1
fi
