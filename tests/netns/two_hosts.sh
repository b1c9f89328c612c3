#!/usr/bin/env bash
# Two hosts on one machine: network namespaces joined by a veth pair
# (10.231.7.1 and 10.231.7.2, a private range), one `colossalai run` per host
# with --nnodes 2. First DDP and ZeRO-2 train across them and must match one
# process; then the link is taken down mid-training and every rank must raise
# within the collective timeout, both launchers exit non-zero, nothing hangs.
# With FINETUNE_LM, an elastic job (--nnodes 1:2) fine-tunes across them:
# host b dies whole, the job goes on alone on host a, host b comes back and
# the job grows to both again and completes (NOTE [Elastic rendezvous]).
#
#   tests/netns/two_hosts.sh CLI TEST_BINARY [FINETUNE_LM]
#
# Needs root and `ip` (iproute2); exits 77 (skipped) where namespaces cannot
# be made.
set -uo pipefail
cli="$1"
binary="$2"
trainer="${3:-}"
tag="cai$$"
log="$(mktemp -d)"

source "$(dirname "$0")/two_namespaces.sh"
two_namespaces "$tag" 10.231.7 600

# host NODE_RANK NS IFACE MODE: one launcher, one rank, in the background.
host() {
  in_ns "$2" env GLOO_SOCKET_IFNAME="$3" COLOSSALAI_NETNS_MODE="$4" \
    timeout -s KILL 120 "$cli" run --nnodes 2 --node_rank "$1" --nproc_per_node 1 \
      --master_addr 10.231.7.1 --master_port 29611 \
      "$binary" --gtest_filter=DistributedFaults.RankOnTwoHosts \
      >"$log/$4.$1" 2>&1
}

status=0
echo "== training across two hosts (DDP, ZeRO-2)"
host 0 "$a" "$va" train & p0=$!
host 1 "$b" "$vb" train & p1=$!
wait $p0; r0=$?
wait $p1; r1=$?
if [[ $r0 != 0 || $r1 != 0 ]] || ! grep -q "zero2 across hosts matches one process" "$log/train.0"; then
  echo "FAIL: training across hosts (launcher exit codes $r0, $r1)"
  tail -n 30 "$log/train.0" "$log/train.1"
  status=1
else
  grep -h "across hosts" "$log/train.0" "$log/train.1"
fi

echo "== dropping the link mid-training"
host 0 "$a" "$va" drop & p0=$!
host 1 "$b" "$vb" drop & p1=$!
for _ in $(seq 600); do
  grep -q TRAINING "$log/drop.0" 2>/dev/null && grep -q TRAINING "$log/drop.1" 2>/dev/null && break
  sleep 0.1
done
start=$(date +%s%N)
in_ns "$a" ip link set "$va" down
wait $p0; r0=$?
wait $p1; r1=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
grep -h "raised after" "$log/drop.0" "$log/drop.1"
echo "launchers exited with $r0 and $r1, ${elapsed_ms} ms after the link went down"
if [[ $r0 == 0 || $r1 == 0 || $r0 == 137 || $r1 == 137 ]]; then
  echo "FAIL: a launcher succeeded or had to be killed (0 / 137)"
  tail -n 30 "$log/drop.0" "$log/drop.1"
  status=1
fi
if (( elapsed_ms > 40000 )); then
  echo "FAIL: took ${elapsed_ms} ms (collective timeout 10 s)"
  status=1
fi

corpus=/usr/share/games/fortunes/computers
if [[ -n "$trainer" && -e "$corpus" ]]; then
  echo "== an elastic job: host b dies, the job goes on alone, b returns"
  in_ns "$a" ip link set "$va" up # down since the last part
  steps=200
  # node NAME NS IFACE: one elastic launcher of one rank, in the background.
  node() {
    in_ns "$2" env GLOO_SOCKET_IFNAME="$3" COLOSSALAI_NETNS_NODE="$tag$1" \
      timeout -s KILL 400 "$cli" run --nnodes 1:2 --nproc_per_node 1 \
        --rdzv_endpoint 10.231.7.1:29631 \
        --rdzv_conf last_call_timeout=1,join_timeout=120 --max_restarts 3 \
        "$trainer" --data "$corpus" --plugin zero2 --steps $steps --seq-len 32 \
        --batch-size 8 --vocab-size 512 --config llama-tiny --samples 0 \
        --save-every 10 --keep-last 1000 --resume --out "$log/out" \
        --checkpoint "$log/ckpt" >"$log/elastic.$1" 2>&1
  }
  # The pids of host b's launcher and rank.
  node_pids() {
    for p in /proc/[0-9]*; do
      { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "COLOSSALAI_NETNS_NODE=$tag$1" &&
        echo "${p#/proc/}"
    done
  }
  newest() { ls "$log/ckpt" 2>/dev/null | sed -n 's/^checkpoint-//p' | sort -n | tail -1; }
  wait_until() { # SECONDS COMMAND...
    local end=$((SECONDS + $1)); shift
    until "$@"; do (( SECONDS < end )) || return 1; sleep 0.1; done
  }
  node a "$a" "$va" & pa=$!
  node b "$b" "$vb" & pb=$!
  reached() {
    ! kill -0 $pa 2>/dev/null ||
      { grep -q "2 node(s)" "$log/elastic.a" && test -d "$log/ckpt/checkpoint-20"; }
  }
  if ! wait_until 300 reached || ! kill -0 $pa 2>/dev/null; then
    echo "FAIL: the job did not train on both hosts to checkpoint-20"
    tail -c 3000 "$log/elastic.a" "$log/elastic.b"; status=1
  else
    killed_at=$(newest)
    kill -9 $(node_pids b) 2>/dev/null
    wait $pb 2>/dev/null
    start=$(date +%s%N)
    alone() {
      ! kill -0 $pa 2>/dev/null ||
        { grep -q "1 node(s)" "$log/elastic.a" && (( $(newest) >= killed_at + 20 )); }
    }
    if ! wait_until 300 alone || ! kill -0 $pa 2>/dev/null; then
      echo "FAIL: host a did not go on alone after host b died"
      tail -c 3000 "$log/elastic.a"; status=1
    else
      echo "host b killed at checkpoint-$killed_at; host a trained alone to" \
        "checkpoint-$(newest), $(( ($(date +%s%N) - start) / 1000000 )) ms after the kill"
      node b2 "$b" "$vb" & pb=$!
      start=$(date +%s%N)
      if ! wait_until 120 grep -q "2 node(s)" "$log/elastic.b2"; then
        echo "FAIL: host b could not join again"
        tail -c 3000 "$log/elastic.a" "$log/elastic.b2"; status=1
      else
        echo "host b back: two hosts again $(( ($(date +%s%N) - start) / 1000000 )) ms after it started"
      fi
      wait $pa; ra=$?
      wait $pb; rb=$?
      rows=$(( $(wc -l <"$log/out/losses.csv") - 1 ))
      if [[ $ra != 0 || $rb != 0 || $rows != "$steps" ]]; then
        echo "FAIL: the elastic job ended with $ra and $rb, $rows of $steps loss rows"
        tail -c 3000 "$log/elastic.a" "$log/elastic.b2"; status=1
      else
        echo "the elastic job completed: $rows steps, launchers exited 0 and 0"
      fi
      if ls -A "$log/ckpt" | grep -q '^\.'; then
        echo "FAIL: a partial checkpoint was left: $(ls -A "$log/ckpt" | grep '^\.')"
        status=1
      fi
    fi
  fi
fi
exit $status
