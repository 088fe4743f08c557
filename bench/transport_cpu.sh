#!/bin/bash
# What encrypting the bytes between two hosts costs in CPU, by transport: 1 GB (MB=N for
# another size) sent over TCP between two network namespaces joined by a veth pair,
# directly, through wireguard-go (psctl's tunnel; links of MTU 1500 and 9000, the tunnel
# 80 bytes less, as psctl deploy tunnel sets it) and through stunnel4 (TLS 1.3, a client
# and a server). Prints MB/s and the CPU seconds the tunnel's two processes used. Root;
# wireguard-go and wg (tools/ensure-systemd-tools.sh); stunnel4's part runs only where
# stunnel4 is installed (apt-get install stunnel4). Results: docs/performance.md.
set -eu
MB=${MB:-1024}
WORK=$(mktemp -d)
TAG="ptc$$"
cleanup() {
    ip netns del "${TAG}a" 2>/dev/null || true
    ip netns del "${TAG}b" 2>/dev/null || true
    pkill -f "wireguard-go ${TAG}" 2>/dev/null || true
    pkill -f "stunnel4 ${WORK}" 2>/dev/null || true
}
trap 'cleanup; rm -rf "$WORK"' EXIT
cd "$WORK"
umask 077
cat > sink.py <<'PY'
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
PY
cat > source.py <<'PY'
import socket, sys, time
mb, buf = int(sys.argv[3]), b"x" * (1 << 20)
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.1)
t = time.monotonic()
for _ in range(mb):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(f"{mb / (time.monotonic() - t):.0f} MB/s", end="")
PY
cpu() {  # CPU seconds (user + system) of the processes $@
    local ticks=0 f
    for pid in "$@"; do
        read -r -a f < "/proc/$pid/stat"
        ticks=$((ticks + f[13] + f[14]))
    done
    echo "scale=2; $ticks / $(getconf CLK_TCK)" | bc
}
hosts() {  # two namespaces, a veth pair of MTU $1 between them
    ip netns add "${TAG}a"
    ip netns add "${TAG}b"
    ip link add "${TAG}x" netns "${TAG}a" type veth peer name "${TAG}y" netns "${TAG}b"
    ip -n "${TAG}a" addr add 10.44.0.1/24 dev "${TAG}x"
    ip -n "${TAG}b" addr add 10.44.0.2/24 dev "${TAG}y"
    ip -n "${TAG}a" link set "${TAG}x" mtu "$1" up
    ip -n "${TAG}b" link set "${TAG}y" mtu "$1" up
    ip -n "${TAG}a" link set lo up
    ip -n "${TAG}b" link set lo up
}
send() {  # $1: address in b, $2: port there; $3...: the tunnel's pids
    local host=$1 port=$2 sink before
    shift 2
    ip netns exec "${TAG}b" python3 sink.py "$([ "$host" = 127.0.0.1 ] && echo 127.0.0.1 || echo 0.0.0.0)" "$port" &
    sink=$!
    sleep 0.3
    before=$( (($#)) && cpu "$@" || echo 0)
    ip netns exec "${TAG}a" python3 source.py "${LOCAL:-$host}" "${LOCAL_PORT:-$port}" "$MB"
    wait "$sink"
    (($#)) && echo ", tunnel processes $(echo "$(cpu "$@") - $before" | bc) CPU s for $MB MB" || echo
}

hosts 1500
printf "direct, MTU 1500: "
send 10.44.0.2 5001
cleanup

for link in 1500 9000; do
    hosts "$link"
    wg genkey > ka && wg pubkey < ka > pa && wg genkey > kb && wg pubkey < kb > pb
    for side in a b; do
        ip netns exec "${TAG}${side}" wireguard-go "${TAG}${side}" > /dev/null 2>&1
    done
    sleep 0.5
    ip netns exec "${TAG}a" wg set "${TAG}a" listen-port 51820 private-key ka \
        peer "$(cat pb)" allowed-ips 10.45.0.2/32 endpoint 10.44.0.2:51820
    ip netns exec "${TAG}b" wg set "${TAG}b" listen-port 51820 private-key kb \
        peer "$(cat pa)" allowed-ips 10.45.0.1/32 endpoint 10.44.0.1:51820
    for side in a b; do
        ip -n "${TAG}${side}" addr add "10.45.0.$([ $side = a ] && echo 1 || echo 2)/24" dev "${TAG}${side}"
        ip -n "${TAG}${side}" link set "${TAG}${side}" mtu $((link - 80)) up
    done
    printf "wireguard-go, link MTU %s (tunnel %s): " "$link" $((link - 80))
    send 10.45.0.2 5002 $(pgrep -f "wireguard-go ${TAG}")
    cleanup
done

if command -v stunnel4 > /dev/null; then
    hosts 1500
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout key.pem \
        -out cert.pem -days 1 -subj /CN=psctl-transport-cpu 2> /dev/null
    common="foreground = yes\npid =\ncert = $WORK/cert.pem\nkey = $WORK/key.pem\nverifyPeer = yes\nCAfile = $WORK/cert.pem\n"
    printf "${common}[server]\naccept = 10.44.0.2:6000\nconnect = 127.0.0.1:5003\n" > "$WORK/s.conf"
    printf "${common}[client]\nclient = yes\naccept = 127.0.0.1:6001\nconnect = 10.44.0.2:6000\n" > "$WORK/c.conf"
    ip netns exec "${TAG}b" stunnel4 "$WORK/s.conf" 2> /dev/null &
    ip netns exec "${TAG}a" stunnel4 "$WORK/c.conf" 2> /dev/null &
    sleep 1
    printf "stunnel4 (TLS), link MTU 1500: "
    LOCAL=127.0.0.1 LOCAL_PORT=6001 send 127.0.0.1 5003 $(pgrep -f "stunnel4 $WORK")
    cleanup
else
    echo "stunnel4: not installed (apt-get install stunnel4), left out"
fi
