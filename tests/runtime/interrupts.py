"""An interrupted cell, as the tests make one: SIGINT to this process once the ranks are running.

A fixed delay races with start-up, which a busy machine or a CUDA build of torch (whose
import, in the launcher's fork server, takes seconds) slows down; so the signal is sent
when the ranks have written ``count`` files into ``pid_dir`` (after their first batch, or
once they sleep), not after a guessed number of seconds.
"""

import os
import signal
import threading
import time


def interrupt_when_ranks_run(pid_dir: str, launch_ended: threading.Event, count: int = 2) -> threading.Thread:
    """The thread that sends it; its ``sent_at`` is the ``time.monotonic()`` of the signal (None if none)."""

    def wait_then_interrupt():
        while len(os.listdir(pid_dir)) < count:
            if launch_ended.wait(0.02):  # the launch failed before its ranks got going: nothing to interrupt
                return
        thread.sent_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=wait_then_interrupt, daemon=True)
    thread.sent_at = None
    thread.start()
    return thread
