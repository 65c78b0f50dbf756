#!/usr/bin/env bash
# A Ray cluster of two nodes on one machine: two network namespaces joined by a veth pair, each node with
# its own address (198.18.0.0/15, the range reserved for network benchmarks), one CPU and its own Ray
# directory; the head in the first, a worker in the second. All traffic stays inside the two namespaces:
# run every command that talks to the cluster through `run A|B`. Needs root (ip netns); the tests of
# tests/test_two_nodes.py use it, and so can you, to try a cluster on a laptop (docs/scale.md).
#
#   scripts/two_nodes.sh up               # start both nodes; waits until Ray lists both alive
#   scripts/two_nodes.sh run A|B CMD...   # run CMD in node A's (B's) namespace, with the cluster's token
#   scripts/two_nodes.sh stop B           # node B lost (its processes killed); returns once Ray sees it dead
#   scripts/two_nodes.sh start B          # node B joins again
#   scripts/two_nodes.sh delay 1ms        # both ends of the link delayed (tc netem); `delay 0` removes it
#   scripts/two_nodes.sh down             # everything stopped by PID, namespaces and files removed
#
# TWO_NODES_DIR (default /tmp/specdraft-two-nodes) holds the token and the nodes' logs; TWO_NODES_NAME
# (default sdn) prefixes the namespaces and links. The cluster's address is 198.18.0.1:6379; its token
# authentication (RAY_AUTH_MODE=token) keeps anything else off it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${TWO_NODES_DIR:-/tmp/specdraft-two-nodes}
NAME=${TWO_NODES_NAME:-sdn}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RAY=$(dirname "$PY")/ray
HEAD=198.18.0.1 WORKER=198.18.0.2 PORT=6379
RAYDIR=/tmp/$NAME-ray  # Ray's directories: a short path (its sockets' paths must stay under 108 bytes)
JOIN=${TWO_NODES_JOIN:-$HEAD}  # where node B looks for the head (the tests give a wrong one: a failed join)

ns() { echo "$NAME-$(echo "$1" | tr 'AB' 'ab')"; }
addr() { [ "$1" = A ] && echo $HEAD || echo $WORKER; }
in_ns() {  # in_ns A|B CMD...: CMD in that node's namespace, with the cluster's token
  local node=$1; shift
  ip netns exec "$(ns "$node")" env RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/token" \
    RAY_USAGE_STATS_ENABLED=0 "$@"
}
start_node() {
  local node=$1 a; a=$(addr "$node")
  mkdir -p "$RAYDIR-$node"
  if [ "$node" = A ]; then
    in_ns A "$RAY" start --head --node-ip-address $HEAD --port $PORT --num-cpus 1 --temp-dir "$RAYDIR-A" \
      --include-dashboard false --disable-usage-stats > "$DIR/node-A.log" 2>&1 || {
      echo "error: the head did not start" >&2; tail -3 "$DIR/node-A.log" >&2; return 1; }
  else
    in_ns B timeout "${TWO_NODES_JOIN_TIMEOUT:-60}" "$RAY" start --address "$JOIN:$PORT" --node-ip-address "$a" --num-cpus 1 --temp-dir "$RAYDIR-B" \
      --disable-usage-stats > "$DIR/node-B.log" 2>&1 || {
      echo "error: node B did not join the head at $JOIN:$PORT" >&2; tail -3 "$DIR/node-B.log" >&2; return 1; }
  fi
}
wait_alive() {  # until Ray lists exactly N alive nodes (at most 90 s): 1 once it has seen a stopped node dead
  in_ns A "$PY" - "$1" <<'EOF'
import sys, time
import ray
ray.init(address="198.18.0.1:6379", log_to_driver=False, configure_logging=False)
want, t0 = int(sys.argv[1]), time.time()
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) == want:
        print("two_nodes: alive:", " ".join(alive))
        break
    if time.time() - t0 > 90:
        sys.exit(f"error: {len(alive)} Ray nodes alive after 90 s, not {want}: {alive}")
    time.sleep(0.5)
EOF
}
kill_node() {  # every process in the node's namespace, by PID
  local pids; pids=$(ip netns pids "$(ns "$1")" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
}
down() {
  for n in A B; do kill_node $n; ip netns del "$(ns $n)" 2>/dev/null || true; done
  rm -rf "$DIR" "$RAYDIR-A" "$RAYDIR-B"
}

case "${1:-}" in
  up)
    [ "$(id -u)" = 0 ] || { echo "error: two_nodes.sh needs root (ip netns)" >&2; exit 2; }
    down
    mkdir -p "$DIR"
    "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$DIR/token"
    ip netns add "$(ns A)" && ip netns add "$(ns B)"
    ip link add "$NAME-va" type veth peer name "$NAME-vb"
    ip link set "$NAME-va" netns "$(ns A)" && ip link set "$NAME-vb" netns "$(ns B)"
    ip -n "$(ns A)" addr add $HEAD/15 dev "$NAME-va" && ip -n "$(ns B)" addr add $WORKER/15 dev "$NAME-vb"
    for n in A B; do
      ip -n "$(ns $n)" link set lo up && ip -n "$(ns $n)" link set "$NAME-v$(echo $n | tr AB ab)" up
    done
    start_node A && start_node B && wait_alive 2 || { down; exit 1; }
    echo "two_nodes: the cluster is $HEAD:$PORT (scripts/two_nodes.sh run A|B CMD...)" ;;
  run) shift; node=$1; shift; in_ns "$node" "$@" ;;
  stop) kill_node "$2"; if [ "$2" = B ]; then wait_alive 1; fi ;;  # returns once Ray has marked B dead
  start) start_node "$2" && wait_alive 2 ;;
  delay)
    for n in A B; do
      dev="$NAME-v$(echo $n | tr AB ab)"
      if [ "$2" = 0 ]; then ip -n "$(ns $n)" link show "$dev" > /dev/null && \
        ip netns exec "$(ns $n)" tc qdisc del dev "$dev" root 2>/dev/null || true
      else ip netns exec "$(ns $n)" tc qdisc replace dev "$dev" root netem delay "$2" 2>/dev/null || {
        echo "error: tc netem is not available here (the kernel lacks sch_netem)" >&2; exit 2; }; fi
    done ;;
  down) down ;;
  *) sed -n 2,17p "$0" >&2; exit 2 ;;
esac
