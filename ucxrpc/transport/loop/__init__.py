"""Who turns the progress loop, and when it may poll.

* :mod:`.progress`: the progress thread, a caller that drives the loop
  itself while it waits (``drive``), and the strategies (adaptive, polling,
  blocking) that decide whether a turn may poll or must sleep in epoll.
* :mod:`.interrupts`: SIGINT while a thread holds the loop.

Imports nothing else of the transport: the loop turns a callable it is given.
"""
