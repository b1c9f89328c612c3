#!/usr/bin/env bash
# Two nodes on one machine joined by a network link of a chosen rate:
# network namespaces joined by a veth pair (10.231.9.1 and 10.231.9.2, a
# private range), each end shaped by a token bucket (tc tbf) to RATE, one
# `colossalai run --nnodes 2` per node with NPROC_PER_NODE ranks each (1
# unset; the ranks of one node talk inside its namespace, unshaped). Runs
# BENCH with its arguments on both; rank 0's output (on node 0) is
# printed. For what a step costs across nodes (fp8_communication, bytes on
# the wire) on a machine that has no second host. NICS=K joins the nodes by
# K links (10.231.9 + k - 1), each shaped to RATE, and local rank i sends
# from link i mod K: one NIC per rank, as multi-rail hosts have.
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
ends_a=("$va") ends_b=("$vb")
for ((k = 2; k <= ${NICS:-1}; ++k)); do
  ea="${tag}a$k" eb="${tag}b$k" net="10.231.$((8 + k))"
  ip link add "$ea" type veth peer name "$eb" || skip "cannot create a veth pair"
  ip link set "$ea" netns "$a" && ip link set "$eb" netns "$b"
  in_ns "$a" ip addr add "$net.1/24" dev "$ea"
  in_ns "$b" ip addr add "$net.2/24" dev "$eb"
  in_ns "$a" ip link set "$ea" up
  in_ns "$b" ip link set "$eb" up
  ends_a+=("$ea") ends_b+=("$eb")
done
for ns in "$a" "$b"; do
  # A rank's replies may return on another link than its peer sent on.
  for conf in all default "${ends_a[@]}" "${ends_b[@]}"; do
    in_ns "$ns" sysctl -qw "net.ipv4.conf.$conf.rp_filter=0" 2>/dev/null
  done
done
# Each direction is limited where it leaves: a 1 MiB bucket, packets
# waiting at most 50 ms.
for ((k = 0; k < ${#ends_a[@]}; ++k)); do
  for end in "$a:${ends_a[k]}" "$b:${ends_b[k]}"; do
    in_ns "${end%%:*}" tc qdisc add dev "${end#*:}" root tbf rate "$rate" \
      burst 1mbit latency 50ms || skip "tc cannot shape the link"
  done
done

# Local rank i binds Gloo to link i mod NICS.
pick_nic='ends=($NETNS_LINK_ENDS); export GLOO_SOCKET_IFNAME="${ends[LOCAL_RANK % ${#ends[@]}]}"; exec "$@"'
node() {
  in_ns "$2" env GLOO_SOCKET_IFNAME="$3" NETNS_LINK_ENDS="$4" \
    "$cli" run --nnodes 2 --node_rank "$1" --nproc_per_node "${NPROC_PER_NODE:-1}" \
      --master_addr 10.231.9.1 --master_port 29651 \
      bash -c "$pick_nic" netns_rank "${@:5}" >"$log/node.$1" 2>&1
}
# Bytes each end has sent: what crossed the links, headers included.
sent() {
  local ns="$1" total=0 dev
  for dev in "${@:2}"; do
    total=$(( total + $(in_ns "$ns" ip -s -j link show dev "$dev" |
      python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])') ))
  done
  echo "$total"
}
a0=$(sent "$a" "${ends_a[@]}"); b0=$(sent "$b" "${ends_b[@]}")
per_link0=(); for e in "${ends_a[@]}"; do per_link0+=("$(sent "$a" "$e")"); done
node 0 "$a" "$va" "${ends_a[*]}" "${@}" & p0=$!
node 1 "$b" "$vb" "${ends_b[*]}" "${@}" & p1=$!
wait $p0; r0=$?
wait $p1; r1=$?
cat "$log/node.0"
echo "link: ${NICS:-1} x $rate; bytes sent by node 0: $(( $(sent "$a" "${ends_a[@]}") - a0 )), by node 1: $(( $(sent "$b" "${ends_b[@]}") - b0 ))"
if (( ${#ends_a[@]} > 1 )); then
  echo -n "bytes sent by node 0 per link:"
  for ((k = 0; k < ${#ends_a[@]}; ++k)); do
    echo -n " $(( $(sent "$a" "${ends_a[k]}") - per_link0[k] ))"
  done
  echo
fi
if [[ $r0 != 0 || $r1 != 0 ]]; then
  echo "FAILED: launchers exited with $r0 and $r1; node 1's output:"
  tail -n 30 "$log/node.1"
  exit 1
fi
