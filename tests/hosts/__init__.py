"""The two-host tier: ucxrpc between two simulated hosts on one machine.

Each test makes two hosts (:mod:`ucxrpc.bench.netns`: two network
namespaces joined by a veth pair; every worker in namespaces of its own,
with a private ``/dev/shm``), starts its workers on them with
``ip netns exec`` (:mod:`tests.hosts._harness`, workers in
:mod:`tests.hosts._worker`) and runs ucxrpc across the link, over UCX's
``tcp`` as between two machines:

* ``test_pair.py``: one pair of workers, one per host, kept up for the
  module: RPC both ways with tensors up to 64 MiB, remote errors, RRefs,
  distributed autograd with DistributedOptimizer, RemoteModule;
* ``test_kill.py``: a worker on the other host SIGKILLed mid-call and idle;
* ``test_torchrun.py``: ``torchrun --nnodes 2`` (c10d rendezvous), one node
  per host, running ``examples/rnn_remote_embedding.py`` unchanged.

Needs root, iproute2 and util-linux (``.ci/run`` installs them); skipped
with the reason otherwise.  Run it alone with ``python -m pytest
tests/hosts`` (about 35 s on 2 cores).  The partitions between the two
hosts are in ``tests/faults/test_partition.py``.
"""
