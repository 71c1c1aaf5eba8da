"""engine/signal_watch.py: a signal becomes one call on a thread of its own; the handler keeps
SA_RESTART (as the Triton stub's did); close() puts back what it replaced."""
import ctypes
import os
import signal
import struct
import threading

from engine.signal_watch import SignalWatch

SA_RESTART = 0x10000000


def _sa_flags(signum):
    """sa_flags of the handler installed now (glibc's struct sigaction on Linux: handler,
    128-byte mask, int flags)."""
    libc = ctypes.CDLL(None, use_errno=True)
    action = ctypes.create_string_buffer(256)
    assert libc.sigaction(signum, None, action) == 0, ctypes.get_errno()
    return struct.unpack_from("i", action, 8 + 128)[0]


def test_the_first_watched_signal_is_one_call_on_the_watch_thread():
    calls, called = [], threading.Event()

    def on_signal(signum):
        calls.append((signum, threading.current_thread().name))
        called.set()

    def other(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR2, other)
    watch = SignalWatch([signal.SIGUSR1], on_signal)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)        # not watched: its byte is passed over
        os.kill(os.getpid(), signal.SIGUSR1)
        assert called.wait(10)
        os.kill(os.getpid(), signal.SIGUSR1)        # a second one: no second call
    finally:
        watch.close()                               # reads what is left, then its thread ends
        signal.signal(signal.SIGUSR2, previous)
    assert calls == [(signal.SIGUSR1, "signal-watch")]


def test_the_handler_keeps_sa_restart_and_close_puts_back_python_handlers():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        watch = SignalWatch([signal.SIGUSR1], lambda signum: None)
        assert signal.getsignal(signal.SIGUSR1) is not mine
        assert _sa_flags(signal.SIGUSR1) & SA_RESTART
        watch.close()
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.set_wakeup_fd(-1) == -1       # and no wakeup fd, as before
    finally:
        signal.signal(signal.SIGUSR1, previous)
