"""Control plane: the store every rank publishes its summaries to and the diagnoser reads
(``plane``), the clock handshake through it (``clock``), and requests to it that give up
in time when its host or link is gone (``deadline``)."""

from ccld_plugin.control.clock import ClockSync, resync_epoch
from ccld_plugin.control.deadline import DeadlineStore, StoreTimeout, request_timeout_s
from ccld_plugin.control.plane import ControlPlane, owner_record

__all__ = [
    "ClockSync",
    "ControlPlane",
    "DeadlineStore",
    "StoreTimeout",
    "owner_record",
    "request_timeout_s",
    "resync_epoch",
]
