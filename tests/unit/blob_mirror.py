"""A real HTTP mirror on loopback for the cache's tests: the standard library's server, serving a
published blob folder with Range requests (which http.server's own handler lacks), and faults
to order: a body cut short, wrong bytes, junk after the body, a false Content-Length, a stall,
a slow link, a drip."""

from __future__ import annotations

import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)  # a client that hung up is no news


class Mirror:
    def __init__(self, root: str):
        self.root = root
        self.requests: list[tuple[str, str]] = []  # (path, Range header or "")
        self.cut_after: int | None = None  # close the connection after this many body bytes
        self.lie = False  # flip the first byte of every body
        self.stall_s = 0.0  # wait this long before answering
        self.ignore_range = False
        self.rate_bytes_per_s: float | None = None  # a slow link: the body goes out at this rate
        self.sent = 0  # body bytes written, all requests together
        self.pad = 0  # append this many junk bytes to every body (a hostile mirror)
        self.content_length: int | None = None  # announce this Content-Length instead
        self.drip_s = 0.0  # send the body one byte at a time, this long apart
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                mirror.requests.append((self.path, self.headers.get("Range", "")))
                if mirror.stall_s:
                    time.sleep(mirror.stall_s)
                if not re.fullmatch(r"/blobs/[0-9a-f]{2}/[0-9a-f]{64}", self.path):
                    self.send_error(404)
                    return
                path = os.path.join(mirror.root, self.path.lstrip("/"))
                if not os.path.isfile(path):
                    self.send_error(404)
                    return
                with open(path, "rb") as fh:
                    data = fh.read()
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if match and not mirror.ignore_range:
                    start = int(match.group(1))
                    if start >= len(data):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                if mirror.lie and body:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                body += b"\0" * mirror.pad
                length = mirror.content_length if mirror.content_length is not None else len(body)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if mirror.drip_s:
                    try:
                        for i in range(len(body)):
                            self.wfile.write(body[i:i + 1])
                            self.wfile.flush()
                            mirror.sent += 1
                            time.sleep(mirror.drip_s)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                if mirror.cut_after is not None:
                    self.wfile.write(body[:mirror.cut_after])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if mirror.rate_bytes_per_s:
                    step = 4096
                    try:
                        for i in range(0, len(body), step):
                            self.wfile.write(body[i:i + step])
                            self.wfile.flush()
                            mirror.sent += len(body[i:i + step])
                            time.sleep(step / mirror.rate_bytes_per_s)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client stopped reading (and resumes with a range later)
                    return
                self.wfile.write(body)
                mirror.sent += len(body)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Mirror":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets_of(self, sha256: str) -> list[str]:
        """The Range headers of the requests for one blob."""
        return [rng for path, rng in self.requests if path.endswith(sha256)]
