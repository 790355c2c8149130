"""A Hub that misbehaves: model and dataset ids resolved (launch/hub.py, rl/data/dataset.py) against
a fake Hub on this machine (HF_ENDPOINT's role), through huggingface_hub's real client. Each
failure (an error status, garbage, a connection cut mid-file, silence before the answer or in the
middle of a file) ends within its deadline (`rl/data/hub.py`, shortened here to 1 s) in an error
naming the field, never a traceback or a wait without end; a good answer still downloads."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launch.hub import resolve_model
from rl.config.schema import ConfigError
from rl.data.dataset import DataError, load_table

SHA = "c" * 40
CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
ROWS = b'{"prompt": "1+2=", "answer": "3"}\n'
DEADLINE_S = 1.0
SILENCE_S = 60.0  # how long a silent Hub says nothing: far past every deadline, so only a deadline ends the wait
RELEASE = threading.Event()  # set when a test ends: its silent handlers return


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's API for one model (`org/m`, config.json) and one dataset (`org/d`, train.jsonl),
    misbehaving as `mode` says."""

    mode = "ok"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _answer(self) -> None:
        mode, path = self.mode, self.path
        if mode == "silent" or (mode == "silent_file" and "/resolve/" in path and self.command == "GET"):
            RELEASE.wait(SILENCE_S)  # (the client gives up long before)
            return
        if mode == "500":
            return self._send(500, b"internal error")
        if mode == "404":
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        if path.startswith("/api/"):
            if mode == "garbage":
                return self._send(200, b"<html>Sign in to the hotel wifi</html>", {"Content-Type": "application/json"})
            name = "train.jsonl" if "/datasets/" in path else "config.json"
            body = ROWS if name == "train.jsonl" else CONFIG
            if "/tree/" in path:
                listing = [{"type": "file", "path": name, "size": len(body), "oid": "d" * 40}]
                return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
            info = {"id": "org/x", "sha": SHA, "siblings": [{"rfilename": name}]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        body = ROWS if path.endswith("train.jsonl") else CONFIG
        headers = {"X-Repo-Commit": SHA, "ETag": '"e"'}
        if mode == "cut" and self.command == "GET":  # promises the file, sends 10 bytes, hangs up
            self.send_response(200)
            for key, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body[:10])
            self.close_connection = True
            return
        self._send(200, body, headers)

    do_GET = do_HEAD = _answer


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake Hub as this process's endpoint, online, with an empty cache and 1 s deadlines."""
    from huggingface_hub import constants

    from rl.data import hub as bounded

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    defaults = bounded.CONNECT_TIMEOUT_S, bounded.READ_TIMEOUT_S
    monkeypatch.setattr(bounded, "READ_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(bounded, "CONNECT_TIMEOUT_S", DEADLINE_S)
    bounded.bounded_waits(DEADLINE_S, DEADLINE_S)
    RELEASE.clear()
    yield endpoint
    bounded.bounded_waits(*defaults)  # the defaults again for the rest of the session
    FakeHub.mode = "ok"
    RELEASE.set()
    server.shutdown()


# mode -> what the model's error says (after "model.path='org/m'")
CASES = {
    "500": "is not in the Hugging Face cache",  # huggingface_hub retries, then tries the cache
    "404": "is neither a local folder nor a Hub model",
    "garbage": "not the Hub's JSON",
    "cut": "broke off the connection",
    "silent": "is not in the Hugging Face cache",  # no answer within the deadline: as unreachable
    "silent_file": "did not answer within 1 s",
}


def test_a_good_hub_answer_downloads_into_the_cache(hub, tmp_path):
    folder = resolve_model("org/m")
    assert folder.endswith(f"snapshots/{SHA}") and json.loads(open(f"{folder}/config.json").read())["model_type"]
    table = load_table(["org/d"], "task.train_files")
    assert table[0]["prompt"] == "1+2="


# huggingface_hub retries a cut or silent file download with backoff: 10-22 s, the full lane's
SLOW = ("cut", "silent_file")
# what each case may take: the requests each resolution makes (huggingface_hub's retries 1 s, 2 s,
# 4 s apart), each ended by its deadline; a client that waited out a silence would take SILENCE_S
MOST_S = {"silent": 10.0}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.slow, pytest.mark.full]) if m in SLOW else m
                                  for m in CASES])
def test_a_misbehaving_hub_ends_in_an_error_naming_the_field_within_its_deadline(hub, mode):
    """Both resolutions run in a thread the test waits for at most the case's bound: a client that
    waits out the silence fails here at once instead of hanging the test."""
    FakeHub.mode = mode
    errors: dict[str, Exception] = {}

    def resolve() -> None:
        for name, call in (("model", lambda: resolve_model("org/m")),
                           ("data", lambda: load_table(["org/d:train"], "task.train_files"))):
            try:
                call()
            except Exception as err:  # noqa: BLE001 - checked below
                errors[name] = err

    started = time.monotonic()
    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    # two resolutions, each a few requests with huggingface_hub's retries (1 s, 2 s, 4 s apart)
    worker.join(MOST_S.get(mode, 30))
    took = time.monotonic() - started
    assert not worker.is_alive(), f"still waiting after {took:.0f} s: a request without a deadline"
    assert isinstance(errors.get("model"), ConfigError) and isinstance(errors.get("data"), DataError), errors
    assert str(errors["model"]).startswith("model.path='org/m'") and CASES[mode] in str(errors["model"])
    assert str(errors["data"]).startswith("task.train_files")
    print(f"{mode}: {took:.1f} s: {errors['model']}")
