"""Whether the Hugging Face Hub can answer now, asked without the Hub client's retries: the planner refuses a Hub id
it cannot fetch in seconds (:func:`kveval.planner.model_specs.load_model_spec`)."""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit


def hub_cached(name: str) -> bool:
    """Whether the Hub cache holds ``name``'s config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache  # the Hub client: loaded for a Hub id only

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001  (an id the client refuses, no huggingface_hub: then let transformers say why)
        return False


#: Seconds the planner waits for the Hub's host to accept a connection before it calls the Hub out of reach.
HUB_PROBE_SECONDS = 2.0


def hub_offline(timeout: float | None = None) -> str | None:
    """Why the Hugging Face Hub cannot be reached now, in a few words (``None``: its host, or the HTTPS proxy,
    accepts a connection within ``timeout`` seconds). ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` say so at once;
    else one TCP connection is tried, so that a Hub id that would fail is refused in seconds, not after the Hub
    client's retries (about 25 s). ``timeout``: :data:`HUB_PROBE_SECONDS` unless given."""
    timeout = HUB_PROBE_SECONDS if timeout is None else timeout
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    target = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    if proxy and target.scheme == "https":
        target = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = target.hostname or "huggingface.co"
    try:
        port = target.port or (443 if target.scheme == "https" else 80)
    except ValueError:
        port = 443
    outcome: list = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=probe, daemon=True)  # name resolution has no timeout of its own
    worker.start()
    worker.join(timeout + 0.5)
    if outcome and outcome[0] is None:
        return None
    if outcome:
        error = outcome[0]
        why = f": {type(error).__name__}" + (f" ({error.strerror})" if getattr(error, "strerror", None) else "")
    else:
        why = f": no answer in {timeout:g} s"
    return f"{host}:{port} unreachable{why}"


__all__ = ["HUB_PROBE_SECONDS", "hub_cached", "hub_offline"]
