#!/usr/bin/env bash
# Download what the GPU machine lacks into ./.whl, for a GPU run to carry
# (the machine reaches no package registry): the ucxx wheels (CUDA 13,
# CPython 3.12, x86-64) and py-spy, which benchmarks/gpu_check.sh's percall
# step samples both ranks with.  The GPU image already has torch, CuPy,
# numpy, pytest, pytest-timeout, cuda-bindings and nvidia-ml-py.
#
#   bash benchmarks/gpu_wheels.sh          # from the project root, ~55 MB
#
# Then carry ".whl" (the device tool's `carry`); gpu_check.sh installs the
# wheels offline with `pip --target` into $TMPDIR/ucxrpc-gpu-site when ucxx
# does not import, and finds py-spy in its bin/.
#
# Also, in .whl/netns-tools/ (~5 MB, where apt-get and dpkg-deb are here):
# iproute2 and iptables-legacy, which the GPU image (Ubuntu 24.04) lacks and
# the partition test needs (tests/hosts/test_outage.py, two network
# namespaces).  Debian 12's packages and the libraries they link are unpacked
# there, behind wrappers in its bin/ that set the library path for
# themselves alone; gpu_check.sh puts bin/ on PATH where `ip` is missing.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  'ucxx-cu13==0.52.*' 'libucxx-cu13==0.52.*' 'libucx-cu13>=1.19,<1.22' \
  'rmm-cu13==26.10.*' 'librmm-cu13==26.10.*' 'rapids-logger==0.3.*'
# py-spy is one static binary in a py3-none wheel.
python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d .whl 'py-spy>=0.4'
du -sh .whl

# The partition test's tools (see above).  Debian 12 binaries run on a newer
# glibc (Ubuntu 24.04's 2.39); every library they link beyond glibc's own is
# carried, so nothing of the machine's is assumed but the kernel's netns,
# veth and legacy iptables support (the check says which is missing).
tools=.whl/netns-tools
if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  rm -rf "$tools"
  mkdir -p "$tools/debs" "$tools/root" "$tools/bin"
  # iproute2's ip and iptables' legacy binary, and what `ldd` shows they
  # link beyond glibc (libbsd and libmd too: not in every minimal image).
  (cd "$tools/debs" && apt-get download -q iproute2 iptables libbpf1 libelf1 libmnl0 libcap2 \
     zlib1g libbsd0 libmd0 libxtables12 libip4tc2 libip6tc2 >/dev/null 2>&1)
  for deb in "$tools"/debs/*.deb; do dpkg-deb -x "$deb" "$tools/root"; done
  rm -rf "$tools/debs"
  # Only the two programs, the libraries and iptables' extensions travel
  # (the device tool carries 64 MiB in all; the wheels take ~54).
  (cd "$tools/root" && find . \( -type f -o -type l \) \
     ! -path ./bin/ip ! -path ./usr/sbin/xtables-legacy-multi ! -path ./usr/sbin/iptables-legacy \
     ! -path './usr/lib/x86_64-linux-gnu/*' ! -path './lib/x86_64-linux-gnu/*' -delete
   find . -depth -type d -empty -delete)
  for name in ip:bin/ip iptables-legacy:usr/sbin/iptables-legacy; do
    cat >"$tools/bin/${name%%:*}" <<WRAP
#!/bin/sh
# ${name%%:*} from Debian 12, with the libraries carried beside it (gpu_wheels.sh).
root=\$(cd "\$(dirname "\$0")/../root" && pwd)
lib=\$root/usr/lib/x86_64-linux-gnu:\$root/lib/x86_64-linux-gnu
LD_LIBRARY_PATH=\$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} \\
XTABLES_LIBDIR=\$root/usr/lib/x86_64-linux-gnu/xtables \\
exec "\$root/${name#*:}" "\$@"
WRAP
    chmod +x "$tools/bin/${name%%:*}"
  done
  du -sh "$tools"
else
  echo "no apt-get/dpkg-deb here: $tools not made (the partition test stays unrun on a GPU machine without ip)"
fi
