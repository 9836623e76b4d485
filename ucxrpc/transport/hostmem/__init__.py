"""Host memory between processes of one host.

* :mod:`.pool`: reusable receive buffers, large ones on transparent huge
  pages, which return to the pool when the last tensor over them dies.
* :mod:`.cma`: a large buffer read (or written) straight out of (into) the
  peer's memory with ``process_vm_readv`` / ``process_vm_writev``.
"""
