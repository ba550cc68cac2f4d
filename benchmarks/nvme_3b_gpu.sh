#!/bin/bash
# Issue 17's NVMe offload measured at 3.1B on the GPU machine, against CPU offload in the same call.
# Its image has no libaio, which DeepSpeed's async I/O op (offload to "nvme") links against, and no
# network: bring Debian's two packages from here, once (git-ignored like .whl):
#     grep -qx '/.debs/' .git/info/exclude || echo '/.debs/' >> .git/info/exclude
#     mkdir -p .debs && (cd .debs && apt-get download libaio1 libaio-dev)
# then on the GPU machine (carry ".whl" and ".debs"), after the wheelhouse line:
#     bash benchmarks/nvme_3b_gpu.sh
# The op JIT-builds at the first NVMe run (about a minute). The swap files (~35 GiB at 3.1B, as
# `shardconsole plan` says) go under /tmp/sc-nvme on the machine's 64 GiB disk.
set -u
OUT=${OUT:-/tmp/nvme}
mkdir -p "$OUT" /tmp/sc-nvme
for f in .debs/*.deb; do dpkg -x "$f" /; done
ldconfig
{ df -h /tmp; dd if=/dev/zero of=/tmp/sc-nvme/probe bs=1M count=4096 oflag=direct 2>&1 | tail -1;
  dd if=/tmp/sc-nvme/probe of=/dev/null bs=1M iflag=direct 2>&1 | tail -1; rm -f /tmp/sc-nvme/probe; } > "$OUT/disk.txt"
python3 -m shardconsole doctor > "$OUT/doctor.txt" 2>&1
python3 benchmarks/gpu_runs.py --matrix issue17-nvme --timeout 280 --out "$OUT/nvme.json" 2>&1 | tail -5
