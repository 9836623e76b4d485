"""Device memory on a pipe.

* :mod:`.context`: a current CUDA context for UCX on the threads that call
  into it, and whether torch's allocator gives memory CUDA IPC can share.
* :mod:`.bounce`: device buffers CUDA IPC can share, for a process whose
  allocator makes none (expandable segments, ``cudaMallocAsync``).
* :mod:`.staging`: device buffers staged through pinned host memory where
  a side has no CUDA transport, and many small ones packed into one.
* :mod:`.side`: the transport's CUDA side (:class:`.side.CudaSide`): the
  device UCX works through, its context on the threads that drive, how
  device memory goes to UCX, and where received device buffers are
  allocated.

The kernels that pack and cut are ``ucxrpc._kernels`` (CuPy, CPU fallback).
"""
