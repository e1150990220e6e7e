"""``python -m fwdtrace.recorder FD CONFIG``: a recorder worker, started by :class:`~fwdtrace.Recorder`.

An entry point of fwdtrace's own, run as its own interpreter, so a worker never imports the
user's main script (see ``worker.py``).
"""

from .worker import main

main()
