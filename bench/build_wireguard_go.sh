#!/usr/bin/env bash
# Build a current wireguard-go (batched TUN reads with TSO/GRO, UDP GSO/GRO: the 2023 work that
# Debian 12's 0.0.20220316 lacks) with Debian 12's Go 1.19 and its golang.org/x packages, for
# bench/wan.py's userspace overlay (docs/benchmarks.md). Go 1.19 and the x/sys 0.3 that Debian
# ships lack errors.Join and a few kernel constants, which are filled in here; nothing else changes.
#
#   apt-get install golang-go golang-golang-x-sys-dev golang-golang-x-crypto-dev golang-golang-x-net-dev
#   bash bench/build_wireguard_go.sh SRC OUT   # SRC: a wireguard-go checkout at d0bc03c (2023-10-31)
#   PATH=$(dirname OUT):$PATH python bench/wan.py   # OUT must be named wireguard-go
set -euo pipefail
src=$1 out=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src"/. "$work"
cd "$work"
rm -rf .git tun/netstack   # netstack (gVisor) is a library of its own; the daemon does not use it
sed -i 's/errors\.Join(/joinErrors(/' tun/offload_linux.go tun/tun_linux.go
sed -i 's/unix\.UDP_GRO/udpGRO/g; s/unix\.UDP_SEGMENT/udpSEGMENT/g; s/unix\.SOL_UDP/solUDP/g' conn/*.go
sed -i -E 's/unix\.(TUN_F_(CSUM|TSO4|TSO6|USO4|USO6)|VIRTIO_NET_HDR_[A-Z0-9_]+)/k\1/g' tun/*.go
cat > tun/go119_linux.go <<'EOF'
package tun

import "fmt"

// include/uapi/linux/if_tun.h and virtio_net.h values absent from Debian 12's x/sys 0.3.
const (
	kTUN_F_CSUM                  = 0x01
	kTUN_F_TSO4                  = 0x02
	kTUN_F_TSO6                  = 0x04
	kTUN_F_USO4                  = 0x20
	kTUN_F_USO6                  = 0x40
	kVIRTIO_NET_HDR_F_NEEDS_CSUM = 1
	kVIRTIO_NET_HDR_GSO_NONE     = 0
	kVIRTIO_NET_HDR_GSO_TCPV4    = 1
	kVIRTIO_NET_HDR_GSO_TCPV6    = 4
	kVIRTIO_NET_HDR_GSO_UDP_L4   = 5
)

// joinErrors stands in for errors.Join (Go 1.20).
func joinErrors(errs ...error) error {
	var out error
	for _, e := range errs {
		if e == nil {
			continue
		}
		if out == nil {
			out = e
		} else {
			out = fmt.Errorf("%v; %w", out, e)
		}
	}
	return out
}
EOF
cat > conn/go119_linux.go <<'EOF'
package conn

// Linux's UDP GSO/GRO socket options (include/uapi/linux/udp.h), absent from Debian 12's x/sys 0.3.
const (
	solUDP     = 17
	udpSEGMENT = 103
	udpGRO     = 104
)
EOF
x=/usr/share/gocode/src/golang.org/x
cat > go.mod <<EOF
module golang.zx2c4.com/wireguard

go 1.19

require (
	golang.org/x/crypto v0.4.0
	golang.org/x/net v0.7.0
	golang.org/x/sys v0.3.0
)

replace golang.org/x/crypto => $x/crypto
replace golang.org/x/net => $x/net
replace golang.org/x/sys => $x/sys
replace golang.org/x/term => $x/term
replace golang.org/x/text => $x/text
EOF
rm -f go.sum
GOPROXY=off GOFLAGS=-mod=mod GOPATH="$work/gopath" GOCACHE="$work/cache" go build -o "$out" .
"$out" --version | head -1
