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

source "$(dirname "$0")/../tests/netns/two_namespaces.sh"
command -v tc >/dev/null || skip "needs tc (Debian: iproute2)"
two_namespaces "$tag" 10.231.9 100000
# Each direction is limited where it leaves: a 1 MiB bucket, packets
# waiting at most 50 ms.
for end in "$a:$va" "$b:$vb"; do
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
a0=$(sent "$a" "$va"); b0=$(sent "$b" "$vb")
node 0 "$a" "$va" "${@}" & p0=$!
node 1 "$b" "$vb" "${@}" & p1=$!
wait $p0; r0=$?
wait $p1; r1=$?
cat "$log/node.0"
echo "link: $rate; bytes sent by node 0: $(( $(sent "$a" "$va") - a0 )), by node 1: $(( $(sent "$b" "$vb") - b0 ))"
if [[ $r0 != 0 || $r1 != 0 ]]; then
  echo "FAILED: launchers exited with $r0 and $r1; node 1's output:"
  tail -n 30 "$log/node.1"
  exit 1
fi
