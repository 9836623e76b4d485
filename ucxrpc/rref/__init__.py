"""Remote references: ``remote()``, ``RRef`` and their reference counting.

An RRef names a value living on its *owner*.  Every RRef held outside the
owner is a *fork*, registered with the owner under a fork id before the
message carrying it leaves the sender, so:

* the owner knows every user (a parent keeps its own fork until the child's
  is registered, because registration happens before the child exists);
* a user RRef that dies sends its fork's deletion to the owner;
* an RRef sent to its owner makes no fork there (the owner gets its own
  RRef object back), so the sender's RRef is held until that call is
  answered (``RpcAgent.keep_until_answered``): the owner serves requests on
  a pool, and a deletion sent right behind the request could be served
  before the request's RRef was unpickled, freeing the value under it;
* the owner drops the value once it has no forks and no local RRef object.

Forks held by a worker that dies are dropped by the owner; RRefs owned by a
dead worker fail on use with an error naming it.

Parts: the per-agent records (:mod:`.registry`), the thread that sends
dead users' deletions to owners (:mod:`.janitor`), the functions owners run
(:mod:`.owner`) and proxies run there (:mod:`.proxy`), and the user-facing
``RRef`` and ``remote()`` (:mod:`.handle`).
"""

from __future__ import annotations

from .handle import RRef, remote

__all__ = ["RRef", "remote"]
