"""Verdicts to a web service: one JSON POST per verdict record (``sinks.webhook.url``), from
a thread of the sink's own, each given ``timeout_s`` and retried ``retries`` times
(1 s, 2 s, 4 s ... apart) on a connection error, a timeout, a 5xx or a 429; a diagnoser
round never waits for it. A service that wants another body (Slack, PagerDuty) takes it
through ``ccld_plugin.on_verdict`` or a plugin sink instead."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ccld_plugin.config import WebhookConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import log
from ccld_plugin.sinks.delivery import Delivery

__all__ = ["WebhookError", "WebhookSink"]

BACKOFF_S = 1.0  # before the first retry; doubled for each next one
MAX_BACKOFF_S = 30.0


class WebhookError(RuntimeError):
    """A verdict the service did not take, after every try."""


class WebhookSink:
    def __init__(self, cfg: WebhookConfig) -> None:
        assert cfg.url is not None
        self.cfg = cfg
        self.url: str = cfg.url
        self.delivered = 0
        self._delivery = Delivery("webhook", self._post)

    def emit(self, verdict: Verdict) -> None:
        self._delivery.put(verdict.to_dict())

    def close(self) -> None:
        """Send what is queued (one try each once closing), waiting at most one timeout
        per verdict queued."""
        self._delivery.close(self.cfg.timeout_s * (1 + self._delivery.pending()))

    def _post(self, record: dict) -> None:
        body = json.dumps(record).encode()
        why = ""
        for attempt in range(self.cfg.retries + 1):
            # between tries a pause, cut short when the job ends (close): no more tries then
            pause = min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S)
            if attempt and self._delivery.closing.wait(pause):
                break
            retry, why = self._try(body)
            if not why:
                self.delivered += 1
                return
            if not retry:
                break
            log.debug(
                "ccld: webhook %s: %s; try %d of %d",
                self.url,
                why,
                attempt + 1,
                1 + self.cfg.retries,
            )
        raise WebhookError(f"verdict {record.get('id')} not delivered to {self.url}: {why}")

    def _try(self, body: bytes) -> tuple[bool, str]:
        """One POST: (whether to try again, why it failed; empty when it did not)."""
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "ccld-plugin"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            return exc.code >= 500 or exc.code == 429, f"HTTP {exc.code} {exc.reason}"
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out, a bad answer
            reason = getattr(exc, "reason", exc)
            return True, f"{type(reason).__name__}: {reason}"
        return False, ""
