"""deploy.processes.free_port: ports for services that cannot bind port 0 come from outside the
kernel's ephemeral range, so an outgoing connection cannot take one before its service binds it."""

import socket

from deploy.processes import _ephemeral_range, free_port


def test_free_ports_are_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_is_handed_out_once():
    ports = [free_port() for _ in range(1000)]  # without the check, ~1 - e^-22 to repeat
    assert len(set(ports)) == len(ports)
