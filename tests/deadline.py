"""`within(seconds)`: a block that must finish in time, so a regression to a hang fails fast.

SIGALRM interrupts Python loops and blocking syscalls (open() on a FIFO) alike; the timer is
cleared on the way out. Main thread only (where pytest runs tests).
"""

import signal
from contextlib import contextmanager


@contextmanager
def within(seconds: float):
    def fire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: this input hangs")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
