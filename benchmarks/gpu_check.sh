#!/usr/bin/env bash
# Check every CUDA claim of ucxrpc on a GPU machine, in one command, into one
# report directory:
#
#   bash benchmarks/gpu_check.sh [REPORT_DIR] [STEP ...]
#
# REPORT_DIR defaults to $OUT when set, else ./gpu-check-<time>. STEPs default
# to all of them, in this order:
#   facts     nvidia-smi, driver, compute mode, MIG, torch / CuPy / CUDA versions
#   info      `ucxrpc info`: CUDA, CuPy, cuda_copy, cuda_ipc, memtype cache ready?
#   pytest    every gpu test, UCXRPC_REQUIRE_GPU=1: a skip is a failure; among
#             them the first-run probes of the CUDA path review (2026-11-29):
#             a packed reply into memory freed with work pending, a peer
#             killed mid device transfer (nothing left posted or allocated),
#             a thread with host arguments getting a CUDA reply (left as
#             found), the receive stream, both device paths, a tensor
#             written on a blocking stream (probe 7, with its control),
#             init_rpc's thread left as found (tests/rpc/test_cuda_rpc.py),
#             a partition cutting a 1 GiB device transfer (tests/hosts/
#             test_outage.py, two network namespaces: needs root, ip and
#             iptables-legacy, carried in .whl/netns-tools where the machine
#             lacks them); percall below compares the two paths' cost
#   proto     what UCX picks for ucxrpc's own pipe (UCX_PROTO_INFO=y, probe 1)
#   perftest  ucx_perftest between two processes, cuda memory, UCX_PROTO_INFO=y:
#             sm,cuda_copy,cuda_ipc (expect cuda_ipc zero-copy) and
#             sm,cuda_copy (expect a */mtype pipeline: the staged ceiling)
#   bench     benchmarks/bench_cuda.py, 1 MiB .. 1 GiB: d2d copy (the limit),
#             ucxrpc GPU-direct, staged, torch TensorPipe with device maps,
#             1,000 small tensors packed against one by one
#   bench-ucxrpc  `ucxrpc bench --device cuda` against torch and raw ucxx (JSON, PNG)
#   percall   where a GPU-direct call's time goes (issue 43's per-call budget):
#             benchmarks/percall.py at 1 MiB and 16 MiB, ucxrpc with device
#             buffers through libucp directly (UCXRPC_DEVICE_PATH=ucp, the
#             default) and through ucxx, and torch; then the ucp loop again
#             with py-spy on both ranks: collapsed stacks and a per-frame
#             table per rank (benchmarks/stacks.py), in percall/.  Needs
#             py-spy: carry its wheel (benchmarks/gpu_wheels.sh)
#   floor     the machine's own floor under a no-op: wake-up costs
#             (benchmarks/floor.py), and the host no-op of ucxrpc, raw ucxx
#             and torch with UCX's CUDA transports loaded and without
#             (--transports 'sm,tcp;all'), then on CUDA workers polling
#   reserved  memory_allocated / memory_reserved after 1,000 16 MiB device
#             receives, ucxrpc (receives allocated on a stream of its own)
#             against torch's agent (benchmarks/gpu_reserved.py; the review's
#             finding 6)
#   expandable    bench_cuda at 64 MiB and 1 GiB under
#             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (memory CUDA
#             IPC cannot share: it must go through bounce buffers, bounced_bytes
#             counted, not UCX's own fallback at 0.5 GB/s)
#
# Every step runs under `timeout`, writes <step>.log in the report directory,
# and a failing step does not stop the next; a summary of which steps failed
# ends the run (exit status 1 if any did). GPU_CHECK_DRY_RUN=1 prints each
# step's command instead of running it (tests/rpc/test_gpu_setup.py does);
# GPU_CHECK_PYTHON names the Python to use (default: python3).
# GPU_CHECK_PERCALL_DEVICE=cpu runs the percall step's loops on host tensors:
# the step's own machinery (pid files, py-spy, tables), tried on any machine.
#
# No registry is needed. When ucxx does not import, the wheels carried in
# .whl/ are installed offline (benchmarks/gpu_wheels.sh fetches them) with
# `pip --target` into $TMPDIR, put first on PYTHONPATH (torch, CuPy, numpy
# stay the machine's). pytest and pytest-timeout must import too (the GPU
# image has them); carry them the same way if the machine lacks them:
#   python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
#       -d .whl pytest pytest-timeout
# With the device tool's 10-minute limit per command, run the steps in two
# calls; it brings back at most 8 files from $OUT, so report into a folder
# of its own and tar that, e.g. (all of it took 215 s on an H100, 2026-11-26):
#   bash benchmarks/gpu_check.sh /tmp/r facts info proto pytest perftest;
#   tar czf "$OUT/r.tgz" -C /tmp r
# (On an H200, 2026-11-27, every step with the benches at 3-4 sizes took 327 s.)
# For the per-call budget alone, in one call (carry .whl, from
# benchmarks/gpu_wheels.sh, for ucxx and py-spy):
#   bash benchmarks/gpu_check.sh /tmp/r facts pytest percall floor;
#   tar czf "$OUT/r.tgz" -C /tmp r
set -u

cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
REPORT=${1:-${OUT:-$REPO/gpu-check-$(date +%Y%m%d-%H%M%S)}}
shift $(( $# > 0 ? 1 : 0 ))
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(facts info pytest proto percall floor perftest bench bench-ucxrpc
                                  reserved expandable)
DRY=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$REPORT"
: >"$REPORT/summary.txt"
PY=${GPU_CHECK_PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
declare -a SUMMARY=()
FAILED=0

say() { echo "$*" | tee -a "$REPORT/summary.txt"; }

# run_step NAME SECONDS COMMAND...: COMMAND under timeout, output to NAME.log,
# the log's tail on the console, the outcome in the summary.
run_step() {
    local name=$1 limit=$2
    shift 2
    local log="$REPORT/$name.log" start=$SECONDS rc
    echo "== $name (at most ${limit}s): $*"
    if [ "$DRY" = 1 ]; then
        echo "would run: $*" | tee "$log"
        rc=0
    else
        timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1
        rc=$?
        tail -n 25 "$log"
    fi
    local took=$((SECONDS - start)) what
    case $rc in
        0) what="ok" ;;
        124 | 137) what="FAILED: timed out after ${limit}s" ;;
        *) what="FAILED: exit status $rc" ;;
    esac
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
    SUMMARY+=("$(printf '%-13s %-34s %5ss  %s' "$name" "$what" "$took" "$log")")
}

# Python with ucxx, pytest and pytest-timeout importable: the machine's, or
# the carried wheels installed offline with `pip --target` beside it.  Not
# into a venv: the GPU image's python3 is itself a venv (/opt/torch/.venv),
# and a venv made from one with --system-site-packages sees the base
# interpreter's packages, not torch's (the first GPU run, 2026-11-26).
SITE=${TMPDIR:-/tmp}/ucxrpc-gpu-site
setup_python() {
    if "$PY" -c "import ucxx, pytest, pytest_timeout" 2>/dev/null; then
        return
    fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        say "setup: ucxx, pytest or pytest-timeout missing and no wheels in .whl/"
        return
    fi
    local site=$SITE
    if [ "$DRY" = 1 ]; then
        echo "would install .whl/*.whl offline into $site"
        return
    fi
    timeout 600 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" .whl/*.whl >"$REPORT/setup.log" 2>&1
    export PYTHONPATH="$site:$PYTHONPATH"
    "$PY" -c "import torch, ucxx, pytest, pytest_timeout" >>"$REPORT/setup.log" 2>&1 ||
        say "setup: still missing after the offline install (see setup.log)"
}

# ucxrpc's native core (csrc/), built in place for this machine's Python
# when no build of it imports: the GPU image has gcc or it has not; without
# one, carry ucxrpc/_core.*.so built for the same Python (run's `carry`).
build_core() {
    if "$PY" -c "import ucxrpc._core" 2>/dev/null; then
        return
    fi
    if [ "$DRY" = 1 ]; then
        echo "would build ucxrpc._core in place"
        return
    fi
    timeout 300 "$PY" setup.py -q build_ext --inplace >"$REPORT/build.log" 2>&1 ||
        say "setup: the native core did not build (see build.log): carry ucxrpc/_core.*.so" \
            "built for this Python, or run where a C compiler is"
}

facts() {
    nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current,memory.total,pci.bus_id \
        --format=csv
    nvidia-smi
    nvidia-smi topo -m
    uname -a
    # The Python speed beside every figure (README), and the partition test's tools.
    "$PY" -m timeit "sum(range(10000))"
    echo "uid $(id -u); ip: $(command -v ip || echo none); iptables-legacy: $(command -v iptables-legacy || echo none)"
    echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-}"
    "$PY" - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
try:
    import cupy
    rt, drv = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    print("cupy", cupy.__version__, "runtime", rt, "driver API", drv)
    if torch.version.cuda and str(rt // 1000) != torch.version.cuda.split(".")[0]:
        print("WARNING: CuPy's CUDA major differs from torch's")
except Exception as exc:
    print("cupy: not usable:", type(exc).__name__, exc)
try:
    import libucx, ucxx
    print("ucxx", ucxx.__version__, "UCX", ucxx.get_ucx_version(), libucx.__file__)
except Exception as exc:
    print("ucxx: not importable:", type(exc).__name__, exc)
sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU")
EOF
}

# Two ucx_perftest processes moving cuda memory; what UCX picks is in the log.
perftest() {
    local ucx bin
    ucx=$("$PY" -c 'import libucx, os; print(os.path.dirname(libucx.__file__))' 2>/dev/null)
    bin=$ucx/bin/ucx_perftest
    [ -x "$bin" ] || bin=$(command -v ucx_perftest) || { echo "no ucx_perftest"; return 1; }
    export LD_LIBRARY_PATH="${ucx:+$ucx/lib:}${LD_LIBRARY_PATH-}"
    "${bin%/*}/ucx_info" -d 2>/dev/null | grep -E "Transport: |Device: " | paste - - | sort -u
    local rc=0 tls port server
    for tls in sm,cuda_copy,cuda_ipc sm,cuda_copy; do
        port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        echo "---- UCX_TLS=$tls, tag_bw, cuda -> cuda, 256 MiB"
        UCX_TLS=$tls UCX_PROTO_INFO=y timeout 120 "$bin" -t tag_bw -m cuda -s 268435456 \
            -n 20 -p "$port" >"$REPORT/perftest-server-${tls//,/_}.log" 2>&1 &
        server=$!
        sleep 3
        UCX_TLS=$tls UCX_PROTO_INFO=y timeout 100 "$bin" 127.0.0.1 -t tag_bw -m cuda \
            -s 268435456 -n 20 -p "$port" || rc=1
        wait "$server" || rc=1
        echo "---- server side:"
        cat "$REPORT/perftest-server-${tls//,/_}.log"
    done
    return $rc
}

# The percall loops (benchmarks/percall.py): JSON lines into percall/loops.jsonl,
# then a sampled run per size with py-spy on both ranks.
percall() {
    local dir=$REPORT/percall rc=0 size impl path spy DEVICE=${GPU_CHECK_PERCALL_DEVICE:-cuda}
    mkdir -p "$dir"
    : >"$dir/loops.jsonl"
    for size in 1M 16M; do
        for impl in ucxrpc:ucp ucxrpc:ucxx torch:ucp; do
            path=${impl#*:}
            echo "---- ${impl%%:*} ($path) $size"
            UCXRPC_DEVICE_PATH=$path timeout 120 "$PY" benchmarks/percall.py \
                --impl "${impl%%:*}" --device "$DEVICE" --size "$size" --seconds 3 \
                >>"$dir/loops.jsonl" || rc=1
            tail -n 1 "$dir/loops.jsonl"
        done
    done
    spy=$(command -v py-spy || ls "$SITE/bin/py-spy" 2>/dev/null)
    if [ -z "$spy" ]; then
        echo "no py-spy: carry its wheel (benchmarks/gpu_wheels.sh); no stacks taken"
        return 1
    fi
    for size in 1M 16M; do
        local pids=$dir/pids-$size loop spies=() r p50
        rm -rf "$pids"
        timeout 200 "$PY" benchmarks/percall.py --device "$DEVICE" --size "$size" --seconds 120 \
            --hold --pid-dir "$pids" >"$dir/sampled-$size.json" &
        loop=$!
        for _ in $(seq 900); do [ -e "$pids/go" ] && break; sleep 0.1; done
        for r in 0 1; do
            "$spy" record --threads --idle --rate 400 --duration 6 --format raw \
                -o "$dir/rank$r-$size.collapsed.txt" --pid "$(cat "$pids/rank$r.pid")" \
                >"$dir/py-spy-rank$r-$size.log" 2>&1 &
            spies+=($!)
        done
        wait "${spies[@]}" || rc=1
        touch "$pids/stop"
        wait "$loop" || rc=1
        cat "$dir/sampled-$size.json"
        p50=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["p50_us"])' \
            "$dir/sampled-$size.json" 2>/dev/null) || p50=
        for r in 0 1; do
            "$PY" benchmarks/stacks.py "$dir/rank$r-$size.collapsed.txt" --top 60 \
                ${p50:+--per-call-us "$p50"} >"$dir/table-rank$r-$size.txt" || rc=1
        done
    done
    return $rc
}

# What the machine charges for a wake-up, and the host no-op with and
# without UCX's CUDA transports, then on CUDA workers with a polling loop.
floor() {
    local rc=0
    "$PY" benchmarks/floor.py || rc=1
    "$PY" -m ucxrpc.bench --device cpu --compare ucxx --compare torch --sizes 4K \
        --transports 'sm,tcp;all' --no-progress --local --no-plot \
        --json "$REPORT/floor-host.json" || rc=1
    UCXRPC_PROGRESS=polling "$PY" -m ucxrpc.bench --device cuda --compare ucxx --sizes 4K \
        --no-progress --local --no-plot --json "$REPORT/floor-cuda-polling.json" || rc=1
    return $rc
}

export PY REPORT SITE
export -f facts perftest percall floor  # run_step runs them as `bash -c NAME`, under timeout

setup_python
build_core
# The partition test's ip and iptables-legacy, carried in .whl/netns-tools
# (benchmarks/gpu_wheels.sh) for a machine without them (the GPU image has
# neither, 2026-11-29): wrappers that find their own libraries.
if ! command -v ip >/dev/null 2>&1 && [ -x "$REPO/.whl/netns-tools/bin/ip" ]; then
    export PATH="$REPO/.whl/netns-tools/bin:$PATH"
    echo "ip and iptables-legacy: the carried ones ($REPO/.whl/netns-tools/bin)"
fi
echo "report: $REPORT; python: $PY; steps: ${STEPS[*]}"
for step in "${STEPS[@]}"; do
    case $step in
        facts) run_step facts 120 bash -c facts ;;
        info) run_step info 180 "$PY" -m ucxrpc.cli info ;;
        # -m gpu over the whole tree: modules without a gpu test are not
        # imported (tests/conftest.py), so none of their dependencies is needed.
        # Bounded within the device tool's 600 s a command (a lent machine
        # gives 15 minutes in all): a run that needs longer takes the step
        # alone, or PYTEST_ADDOPTS=-k to pick.
        pytest) run_step pytest 480 env UCXRPC_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -rs \
            -p no:cacheprovider --junitxml="$REPORT/pytest-gpu.xml" tests ;;
        proto) run_step proto 300 env UCXRPC_REQUIRE_GPU=1 UCX_PROTO_INFO=y "$PY" -m pytest -s \
            -p no:cacheprovider tests/rpc/test_gpu_setup.py -k cuda_ipc_lane ;;
        percall) run_step percall 600 bash -c percall ;;
        floor) run_step floor 400 bash -c floor ;;
        perftest) run_step perftest 400 bash -c perftest ;;
        bench) run_step bench 1800 "$PY" benchmarks/bench_cuda.py \
            --sizes 1M,4M,16M,64M,256M,1G --repeat 5 --timeout 600 ;;
        bench-ucxrpc) run_step bench-ucxrpc 1800 "$PY" -m ucxrpc.bench --device cuda \
            --compare torch --compare ucxx --sizes 1M..1G --no-progress --local \
            --json "$REPORT/bench-ucxrpc-cuda.json" --plot "$REPORT/bench-ucxrpc-cuda.png" ;;
        reserved) run_step reserved 300 "$PY" benchmarks/gpu_reserved.py ;;
        expandable) run_step expandable 900 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            "$PY" benchmarks/bench_cuda.py --sizes 64M,1G --repeat 3 --timeout 300 ;;
        *) say "unknown step: $step"; FAILED=$((FAILED + 1)) ;;
    esac
done

say ""
say "summary ($REPORT):"
for line in "${SUMMARY[@]}"; do say "  $line"; done
if [ "$FAILED" -gt 0 ]; then
    say "$FAILED step(s) failed"
    exit 1
fi
say "every step passed"
