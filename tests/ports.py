"""Free TCP ports for tests that must hand one to torchrun or a TCP store."""

import random
import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now, all below the kernel's ephemeral range: the OS
    never hands one of these out for ``bind(0)`` or an outgoing connection (gloo's pairs, other
    tests' stores), so none is taken between choosing it and binding it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    chosen: list[int] = []
    for port in random.sample(range(10_000, ephemeral_low), min(4000, ephemeral_low - 10_000)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"found fewer than {count} free ports between 10000 and {ephemeral_low}")
