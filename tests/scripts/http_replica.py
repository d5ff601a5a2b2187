"""A small HTTP server standing in for a replica in the router's tests: binds
127.0.0.1:PORT (argv), answers /v2/health/ready with 200 (503 while the file
SICK exists, argv[3]), and any POST with {"replica": NAME, "body": the body},
after DELAY seconds (argv[4], default 0). Every request must carry X-Pai-Token."""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, NAME, SICK = int(sys.argv[1]), sys.argv[2], sys.argv[3]
DELAY = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
TOKEN = os.environ["PAI_SERVING_TOKEN"]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.headers.get("X-Pai-Token") != TOKEN:
            return self.answer(401, {"error": "no token"})
        self.answer(503 if os.path.exists(SICK) else 200, {"replica": NAME})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("X-Pai-Token") != TOKEN:
            return self.answer(401, {"error": "no token"})
        time.sleep(DELAY)
        self.answer(200, {"replica": NAME, "body": body.decode(), "path": self.path,
                          "type": self.headers.get("Content-Type")})

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
server.daemon_threads = True
print(f"{NAME} ready on 127.0.0.1:{PORT}", flush=True)
server.serve_forever()
