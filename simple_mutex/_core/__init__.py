"""The core: what the lock decides, and nothing that waits or talks to a server.

* ``flows``: every cache decision as a generator of cache operations (no I/O).
* ``timing``: every timing rule (deadline margin, renewal and retry times, poll, hand-off).
* ``records``: the JSON lock record and the owner token; ``keys``: a user's key to a cache
  key and back, never escaping its prefix; ``durations``: every accepted duration form.
"""
