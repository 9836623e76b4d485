"""Python function calls per call, on the caller and the callee: an A/B that
noise cannot move (this VM's latency figures move 10-20% from one invocation
to the next; a count of calls does not).

    python benchmarks/calls_per_rpc.py PORT N noop|dict|consume|echo|async OUT.json

Two processes; after 300 warm-up calls (three bursts for ``async``),
``sys.setprofile`` and ``threading.setprofile`` (both set before
``init_rpc`` starts the agent's threads) count every Python and C function
called on every thread of both, over N calls of ``rpc_sync(noop)``, of an
echo of 100 4 KiB tensors in a dict (``dict``), of one 4 KiB tensor sent (``consume``)
or echoed (``echo``), or of 100 ``rpc_async`` no-ops and their
``wait_all`` (``async``: the counts are per 100 calls).  OUT.json holds
the counts per side and N.  To compare two trees, run it from each (``PYTHONPATH=<tree>``) and divide by N
(Run AK did so against 0c6b5a9).  The loop's own functions (polling, yields)
vary with timing; the rest is the work per message.
"""
import collections, json, os, sys, threading
import torch
import torch.multiprocessing as mp

def noop():
    return None

def echo(x):
    return x

def consume(x):
    return None

COUNTS = collections.Counter()
ON = False  # counting: the hook is in every thread from the start, counting only between start and stop

def prof(frame, event, arg):
    if not ON:
        return
    if event == "call":
        c = frame.f_code
        COUNTS[(c.co_filename.split("/ucxrpc/")[-1] if "/ucxrpc/" in c.co_filename else c.co_filename.rsplit("/", 1)[-1], c.co_name)] += 1
    elif event == "c_call":
        COUNTS[("C", getattr(arg, "__qualname__", str(arg)))] += 1

def hook():
    # Before init_rpc: a profile function reaches only the thread that sets
    # it and threads started after threading.setprofile (Python 3.11 has no
    # setprofile_all_threads), and the progress and pool threads start in
    # init_rpc.  Hooked later, their calls went uncounted (before
    # 2026-11-30: the replies of rpc_async, which the progress thread
    # handles, were missing from these counts).
    threading.setprofile(prof); sys.setprofile(prof)

def start():
    global ON
    COUNTS.clear()
    ON = True

def stop():
    global ON
    ON = False
    return {f"{k[0]}:{k[1]}": v for k, v in COUNTS.items()}

def run(rank, port, n, what, out):
    import ucxrpc as rpc
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    hook()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        d = {f"t{i}": torch.randn(1024) for i in range(100)}
        t = torch.ones(1024)  # 4 KiB, as the bench's 4K figures
        call = {"noop": lambda: rpc.rpc_sync("w1", noop),
                "dict": lambda: rpc.rpc_sync("w1", echo, (d,)),
                "consume": lambda: rpc.rpc_sync("w1", consume, (t,)),
                "echo": lambda: rpc.rpc_sync("w1", echo, (t,)),
                # a burst: N of these make 100 * N rpc_async calls
                "async": lambda: torch.futures.wait_all(
                    [rpc.rpc_async("w1", noop) for _ in range(100)])}[what]
        for _ in range(3 if what == "async" else 300): call()  # 300 calls either way
        rpc.rpc_sync("w1", start); start()
        for _ in range(n): call()
        mine = stop(); theirs = rpc.rpc_sync("w1", stop)
        json.dump({"caller": mine, "callee": theirs, "n": n}, open(out, "w"))
    rpc.shutdown()

if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]), nprocs=2)
