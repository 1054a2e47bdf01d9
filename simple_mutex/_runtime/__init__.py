"""The runtime: what runs the core's decisions in a live process.

* ``drivers``: the blocking and the asyncio driver of the flows, and the hand-off marks.
* ``keeper``: the one background thread per process that keeps deadlines and books
  renewals; ``interrupt``: raising a loss inside the holder's thread; ``forksafe``: a
  forked child's copies of leases and pools are never the parent's.
"""
