"""Stand-in for `tokenmill serve` as a subprocess, stdlib only so that it is ready in a blink:
`python fake_serve.py --port P` answers /ready, /metrics and non-streaming completions."""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/ready":
            self._send(200, b'{"status":"ready"}')
        elif self.path == "/metrics":
            self._send(200, b'tokenmill:num_requests_running{model_name="m"} 0.0\n', "text/plain")
        else:
            self._send(404, b'{"error":{"message":"not found"}}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        self._send(200, json.dumps(body).encode())

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
