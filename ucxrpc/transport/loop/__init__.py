"""Who turns the progress loop, and when it may poll.

* :mod:`.progress`: who turns the loop: the progress thread, or a caller
  that drives it itself while it waits (``drive``).
* :mod:`.strategy`: the strategies (adaptive, polling, blocking) that
  decide whether a turn may poll or must sleep in epoll.
* :mod:`.interrupts`: SIGINT while a thread holds the loop.

Imports nothing else of the transport: the loop turns a callable it is given.
"""
