"""Talking to the Hugging Face Hub with every wait bounded, and its failures told in one sentence.

huggingface_hub's HTTP client waits without a timeout by default (`default_client_factory`,
`timeout=None`): a Hub (or a proxy, or a mirror in HF_ENDPOINT) that accepts a connection and
never answers held a launch forever, before any check could speak. `bounded_waits` gives the
client a connect and a read deadline (a download that keeps streaming is never cut; a silence
is), and `hub_failure` says what went wrong when the Hub answered badly or not at all, for the
callers (`launch/hub.py` for models, `rl/data/dataset.py` for datasets) to put after the field.
"""

from __future__ import annotations

import json

# No answer (a response's first byte, or the next chunk of a download) for this long ends the
# request; huggingface_hub retries a few times before it gives up (then the cache is tried).
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0

_installed: tuple[float, float] | None = None  # (connect, read) deadlines of the client in use


def bounded_waits(connect_s: float | None = None, read_s: float | None = None) -> None:
    """Make huggingface_hub's shared HTTP client give up on a silent server: once per process
    with the defaults, or now with the deadlines given (tests)."""
    global _installed
    if connect_s is None and read_s is None and _installed is not None:
        return
    connect_s = CONNECT_TIMEOUT_S if connect_s is None else connect_s
    read_s = READ_TIMEOUT_S if read_s is None else read_s
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import hf_request_event_hook

    deadlines = {"connect": connect_s, "read": read_s, "write": read_s, "pool": connect_s}

    def bounded(request: httpx2.Request) -> None:
        # huggingface_hub passes `timeout=None` (no deadline) per request, which overrides any
        # client default: the deadlines go where the transport reads them, in place of the Nones
        # (a file read keeps huggingface_hub's own, HF_HUB_DOWNLOAD_TIMEOUT, where it is shorter)
        asked = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: v if asked.get(k) is None else min(asked[k], v)
                                         for k, v in deadlines.items()}

    set_client_factory(lambda: httpx2.Client(event_hooks={"request": [hf_request_event_hook, bounded]},
                                             follow_redirects=True))
    _installed = (connect_s, read_s)


def transport_errors() -> tuple[type[BaseException], ...]:
    """What a Hub that does not answer, hangs up or answers garbage raises (not the Hub's own
    'no such repository / revision' answers, which the callers tell apart)."""
    import httpx2

    return httpx2.TransportError, json.JSONDecodeError


def hub_failure(err: BaseException) -> str:
    """One sentence on a transport failure, after '{field}: '."""
    import httpx2
    from huggingface_hub import constants

    where = constants.ENDPOINT
    if isinstance(err, httpx2.TimeoutException):
        what = f"did not answer within {(_installed or (0, READ_TIMEOUT_S))[1]:g} s"
    elif isinstance(err, json.JSONDecodeError):
        what = "answered with something that is not the Hub's JSON (a proxy's or a captive portal's page?)"
    else:
        what = f"broke off the connection ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return (f"the Hub at {where} {what}; retry, check HF_ENDPOINT and any proxy, or work from the cache "
            "(HF_HUB_OFFLINE=1) or from local files")
