"""A ps that listens on LISTEN_ADDR (default 127.0.0.1) at PAI_PORT, as
TensorFlow's servers listen on every interface; a worker that prints once and
then stays quiet for QUIET seconds."""

import os
import socket
import time

if os.environ.get("PAI_ROLE") == "ps":
    sock = socket.socket(socket.AF_INET6 if ":" in os.environ.get("LISTEN_ADDR", "") else socket.AF_INET)
    sock.bind((os.environ.get("LISTEN_ADDR", "127.0.0.1"), int(os.environ["PAI_PORT"])))
    sock.listen()
    print("listening", flush=True)
    while True:
        time.sleep(1)
else:
    print("working", flush=True)
    time.sleep(float(os.environ.get("QUIET", "6")))
    print("done", flush=True)
