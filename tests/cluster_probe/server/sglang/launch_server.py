"""Test-only stand-in for ``sglang.launch_server``: answers ``GET /health`` on ``--port`` until killed, so the
placement test's job starts its trainer. The real server runs in the multi-node study test."""

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=30000)
    args, _ = parser.parse_known_args()
    ThreadingHTTPServer((args.host, args.port), Health).serve_forever()
