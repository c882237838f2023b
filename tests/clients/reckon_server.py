"""Starts `reckon serve` on a free loopback port for the client tests, and stops it."""

import os
import re
import subprocess
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("RECKON_BIN", os.path.join(REPO, "target", "release", "reckon"))


class ReckonServer:
    """`reckon serve ARGS --port 0`; the bound address is read from its start-up line."""

    def __init__(self, *args, timeout=120):
        cmd = [BINARY, "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log = []
        deadline = time.time() + timeout
        self.base = None
        while self.base is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"reckon serve exited ({self.proc.wait()}): {''.join(self.log)}")
            self.log.append(line)
            m = re.search(r"on (http://[\d.:]+)", line)
            if m:
                self.base = m.group(1)
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("reckon serve did not start in time")
        # keep draining stderr so the server never blocks on a full pipe
        threading.Thread(target=lambda: [self.log.append(l) for l in self.proc.stderr], daemon=True).start()
        self.wait_healthy(deadline)

    def wait_healthy(self, deadline):
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("reckon serve is not healthy")
            time.sleep(0.1)

    def metrics(self):
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
