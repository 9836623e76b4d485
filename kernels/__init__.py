"""CUDA C++ sources shipped with ucxrpc (``*.cu``); loaded by ``ucxrpc._kernels``."""
