"""The kernel's word that a peer, or a peer's queue, is gone.

* :mod:`.lifeline`: a TCP connection to each peer's lifeline port, whose end
  the peer's kernel reports the moment the peer's process ends, and TCP
  keepalive for a host that vanishes; one epoll thread for all of them.
* :mod:`.canary`: a probe of this worker's own shared-memory receive queue,
  which a peer killed mid-send can leave stuck.

Silence alone never counts as death here: a busy peer's kernel answers for it.
"""
