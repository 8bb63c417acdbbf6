"""A minimal packet capture (what tcpdump would see): every frame on one interface, appended
raw to a file until SIGTERM. Run inside a test host's namespace:

    ip netns exec HOST python tests/netns_tools/packet_capture.py eth0 OUT_FILE

It prints "capturing" once the socket is bound, so the caller can wait for that."""
from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main(interface: str, out_path: str) -> None:
    stop = False

    def request_stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sniffer.bind((interface, 0))
    sniffer.settimeout(0.2)
    print("capturing", flush=True)
    with open(out_path, "wb") as out:
        while not stop:
            try:
                out.write(sniffer.recv(65535))
            except TimeoutError:
                continue
            except InterruptedError:
                continue


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
