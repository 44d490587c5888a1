"""A command driven through a pseudo-terminal, as a user types into it (stdlib ``pty``, Linux).

The child gets the terminal as its controlling tty (new session + TIOCSCTTY),
so Ctrl-C (``\\x03``) and Ctrl-D (``\\x04``) go through the terminal's line
discipline exactly as typed keys do. Output is read without blocking; ``\\r``
is dropped (the tty turns ``\\n`` into ``\\r\\n``).
"""
import codecs
import fcntl
import os
import pty
import re
import select
import subprocess
import termios
import time


def _take_terminal():   # runs in the child after setsid(): fd 0 is the pty's slave end
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    def __init__(self, argv, *, cwd=None, env=None, timeout=300.0):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                     start_new_session=True, preexec_fn=_take_terminal, close_fds=True)
        os.close(slave)
        self.fd, self.timeout = master, timeout
        self.text, self.pos = "", 0      # everything read; where the next expect starts
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def _read(self, wait: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], wait)
        if not r:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:   # EIO: the child closed the terminal
            data = b""
        if not data:
            return False
        self.text += self._dec.decode(data).replace("\r", "")
        return True

    def expect(self, pattern, timeout=None):
        """The first match of ``pattern`` after the previous match; AssertionError with the output on a timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > deadline or not self._read(0.2):
                if not (m := rx.search(self.text, self.pos)):
                    raise AssertionError(f"no {pattern!r} in the terminal output after position {self.pos}:\n"
                                         f"{self.text[self.pos:][-4000:]}\n--- full output ---\n{self.text[-8000:]}")
                self.pos = m.end()
                return m

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def sendline(self, line: str) -> None:
        self.send(line + "\n")

    def wait(self, timeout=None) -> int:
        deadline = time.monotonic() + (timeout or self.timeout)
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)
