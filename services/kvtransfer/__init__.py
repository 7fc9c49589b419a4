"""KV-cache block transfer between workers: the data plane of disaggregation.

A transport moves one sequence's KV blocks from a sender (prefill worker) into a buffer the
receiver (decode worker) set aside for them. Addresses carry the transport as a scheme:
`ucx://host:port` (UCX through ucxx, the default), `tcp://host:port` (plain sockets, the
fallback and the baseline) or `mooncake://host:port` (Mooncake's Transfer Engine, its control on
a socket at that address). Control (which sequence, where to, the outcome) travels over gRPC.
"""

from services.kvtransfer.base import (  # noqa: F401
    Accepted,
    KVReceiver,
    KVSender,
    Payload,
    TransferError,
    TransferHeader,
    TransferRefused,
)

TRANSPORTS = ("ucx", "tcp", "mooncake")


def create_receiver(transport: str, on_header, on_done) -> KVReceiver:
    """The receiving end for `transport`; call `start(host)` for its address."""
    if transport == "ucx":
        from services.kvtransfer.ucx import UCXReceiver

        return UCXReceiver(on_header, on_done)
    if transport == "tcp":
        from services.kvtransfer.tcp import TCPReceiver

        return TCPReceiver(on_header, on_done)
    if transport == "mooncake":
        from services.kvtransfer.mooncake_te import MooncakeReceiver

        return MooncakeReceiver(on_header, on_done)
    raise ValueError(f"unknown KV transport {transport!r}; use one of {TRANSPORTS}")


class Senders:
    """One sender per transport, made on first use, picked by the address's scheme."""

    def __init__(self):
        self._senders: dict[str, KVSender] = {}

    def send(self, address: str, header: TransferHeader, payload: Payload, timeout_s: float) -> int:
        scheme = address.split("://", 1)[0]
        sender = self._senders.get(scheme)
        if sender is None:
            if scheme == "ucx":
                from services.kvtransfer.ucx import UCXSender

                sender = UCXSender()
            elif scheme == "tcp":
                from services.kvtransfer.tcp import TCPSender

                sender = TCPSender()
            elif scheme == "mooncake":
                from services.kvtransfer.mooncake_te import MooncakeSender

                sender = MooncakeSender()
            else:
                raise TransferError(f"KV address {address!r} names no known transport {TRANSPORTS}")
            self._senders[scheme] = sender
        return sender.send(address.split("://", 1)[1], header, payload, timeout_s)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
