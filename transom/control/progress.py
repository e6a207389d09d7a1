"""The agent's end of `transom.monitor.report`: a UDP listener that keeps the newest step per rank."""

from __future__ import annotations

import json
import socket
import threading
import time


class ProgressListener:
    """Receives workers' step reports on a loopback UDP port in a daemon thread."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.latest: dict[int, dict] = {}  # rank -> newest report
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="progress-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self.sock.recvfrom(65536)
                message = json.loads(data)
                rank = int(message["rank"])
                message["step"] = int(message["step"])
            except (socket.timeout, ValueError, KeyError, TypeError):
                continue
            except OSError:
                return
            message["received"] = time.time()
            with self._lock:
                self.latest[rank] = message

    def newest_step(self) -> int | None:
        with self._lock:
            steps = [m["step"] for m in self.latest.values()]
        return max(steps) if steps else None

    def reset(self) -> None:
        with self._lock:
            self.latest.clear()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
