"""The Tinker REST protocol over a `TinkerService` (launch/tinker/service.py), as the `tinker` 0.38
SDK speaks it: JSON bodies under `/api/v1/`, the `X-API-Key` header, futures fetched with
`retrieve_future` (long-polled), forward_backward and sample results as protobuf
(launch/tinker/proto.py).

Errors are the SDK's: a request refused at submission is a 4xx with `{"detail": ...}` (the SDK
raises BadRequestError, NotFoundError...); a call that fails once running is the future's result
`{"error": ..., "category": "user" | "server"}` (the SDK raises RequestFailedError). Never a 400
without a body (the SDK takes that for a proxy's and retries), never a 402 (it pauses for billing).

A training call numbers itself with its model's next `seq_id` and the model's later calls wait for
that number. So whatever request names a model and a seq_id and is not queued (refused, failed, or
a route not served here at all: a 404) gives its number up (`TinkerService.release`): one refused
call never holds up the calls after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from launch.tinker.futures import UserError
from launch.tinker.proto import WireError, decode_forward_backward
from launch.tinker.service import TinkerService

PROTOBUF = "application/x-protobuf"
log = logging.getLogger("rlpost.tinker")


def _detail(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def make_app(service: TinkerService) -> FastAPI:
    s, registry = service.serve, service.registry
    app = FastAPI(title="rlpost Tinker service", docs_url=None, redoc_url=None, openapi_url=None)
    limit = s.max_request_mib * 2**20

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Every call: the API key (when one is set), the body's size; a refusal the SDK shows as
        the service said it, and nothing else breaks on an unexpected error."""
        # (an archive's URL is its own secret, as a signed URL: the cookbook fetches it with urllib)
        if request.url.path != "/api/v1/healthz" and not request.url.path.startswith("/api/v1/archives/"):
            key = request.headers.get("x-api-key")
            if not key:
                return _detail(401, "no X-API-Key header: give the SDK an api_key (TINKER_API_KEY=tml-...)")
            if s.api_key and key != s.api_key:
                return _detail(401, "this API key is not this service's (serve.api_key)")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            return _detail(413, f"request body of {int(size)} bytes is over serve.max_request_mib={s.max_request_mib}")
        return await call_next(request)

    def give_up_number(request: Request) -> None:
        """The request named a training model's seq_id and was not queued: its number is used up."""
        named = getattr(request.state, "training_call", None)
        if named is not None:
            service.release(*named)

    @app.exception_handler(UserError)
    async def refused(request: Request, err: UserError):
        give_up_number(request)
        return _detail(err.status, str(err))

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception):  # one failed request never takes the service down
        log.exception("request %s failed", request.url.path)
        give_up_number(request)
        return _detail(500, f"{type(err).__name__}: {err}")

    def note_training_call(request: Request, model_id: Any, seq_id: Any) -> None:
        if isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
            request.state.training_call = (model_id, seq_id)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > limit:
            raise UserError(f"request body over serve.max_request_mib={s.max_request_mib}", status=413)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise UserError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise UserError("the request body must be a JSON object")
        note_training_call(request, body.get("model_id"), body.get("seq_id"))
        return body

    def need(body: dict[str, Any], key: str, kind: type | tuple[type, ...] = str) -> Any:
        value = body.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise UserError(f"{key}: required, a {getattr(kind, '__name__', kind)}", status=422)
        return value

    # ---- configuration, sessions ---------------------------------------------------------------

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": False, "sample_no_retries": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.model_name, "max_context_length": service.max_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await body_of(request)
        return {"type": "create_session", "session_id": registry.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        registry.heartbeat(need(await body_of(request), "session_id"))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish(session_id: str):
        service.finish(session_id)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        return {"status": "accepted"}

    # ---- training ------------------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await body_of(request)
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise UserError("lora_config must be an object", status=422)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer_config.type={optimizer!r}: only adamw is served")
        sid = need(body, "session_id")
        seq = need(body, "model_seq_id", int)
        request_id = service.create_model(sid, seq, need(body, "base_model"), lora)
        return {"request_id": request_id, "model_id": f"{sid}:train:{seq}"}

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = await body_of(request)
        if body.get("model_id"):  # TrainingClient.load_state[_with_optimizer], deprecated by the SDK
            raise UserError("load_state / load_state_with_optimizer (a state loaded into an existing training model) "
                            "is not served: use ServiceClient.create_training_client_from_state[_with_optimizer], "
                            "as the SDK advises")
        sid, seq = need(body, "session_id"), need(body, "model_seq_id", int)
        return {"request_id": service.load_model(sid, seq, need(body, "path"), bool(body.get("optimizer"))),
                "model_id": f"{sid}:train:{seq}"}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return service.info(need(await body_of(request), "model_id"))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = await request.body()
        if "protobuf" not in request.headers.get("content-type", ""):
            raise UserError("forward_backward takes a protobuf body (application/x-protobuf), as the tinker SDK "
                            "sends it")
        if request.headers.get("content-encoding"):
            raise UserError("compressed forward_backward bodies are not served (the client config says so)")
        try:
            message = decode_forward_backward(raw)
        except WireError as err:
            raise UserError(str(err)) from None
        note_training_call(request, message.model_id, int(message.seq_id))
        return {"request_id": await asyncio.to_thread(service.forward_backward, message)}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await body_of(request)
        adam = body.get("adam_params")
        if adam is None:
            raise UserError("optim_step: only adam_params are served (no other optimizer)")
        if not isinstance(adam, dict):
            raise UserError("adam_params must be an object", status=422)
        return {"request_id": service.optim_step(need(body, "model_id"), need(body, "seq_id", int), adam)}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        body = await body_of(request)
        name = body.get("path")
        sampler_seq = body.get("sampling_session_seq_id")
        if name is None and not isinstance(sampler_seq, int):
            raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id", status=422)
        return {"request_id": service.save_weights(need(body, "model_id"), need(body, "seq_id", int), name, True,
                                                   None if name is not None else sampler_seq)}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await body_of(request)
        return {"request_id": service.save_weights(need(body, "model_id"), need(body, "seq_id", int),
                                                   body.get("path"), False)}

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request):
        await body_of(request)
        raise UserError("save_weights_external is not served: save_weights_for_sampler(name) writes the adapter as a "
                        "peft folder (Hugging Face format) under the service's run.dir, tinker/<model>/sampler_weights/"
                        "<name>")

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        from trainer.adapter_trainer import saved_spec

        path = need(await body_of(request), "tinker_path")
        folder, model_id = registry.resolve(path)
        if "/weights/" in path:
            spec = saved_spec(folder)
            rank, flags = spec.rank, {k: getattr(spec, k) for k in ("train_unembed", "train_mlp", "train_attn")}
        else:
            with open(f"{folder}/adapter_config.json") as f:
                rank, flags = json.load(f)["r"], {}
        return {"base_model": service.model_name, "is_lora": True, "lora_rank": rank, **flags}

    # ---- training runs and checkpoints (RestClient; the cookbook's weights.download) -------------

    def page(request: Request, default: int) -> tuple[int, int]:
        try:
            limit = int(request.query_params.get("limit", default))
            offset = int(request.query_params.get("offset", 0))
        except ValueError:
            raise UserError("limit and offset must be integers", status=422) from None
        if limit < 1 or offset < 0:
            raise UserError(f"limit={limit} must be >= 1 and offset={offset} >= 0", status=422)
        return limit, offset

    @app.get("/api/v1/training_runs")
    def training_runs(request: Request):
        limit, offset = page(request, 20)
        runs = registry.training_runs()
        return {"training_runs": runs[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    @app.get("/api/v1/training_runs/{model_id}")
    def training_run(model_id: str):
        return registry.training_run(model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    def checkpoints(model_id: str):
        registry.training_run(model_id)  # 404 for a run this service never had
        return {"checkpoints": registry.checkpoints(model_id), "cursor": None}

    @app.get("/api/v1/checkpoints")
    def user_checkpoints(request: Request):
        limit, offset = page(request, 100)
        every = sorted((c for r in registry.training_runs() for c in registry.checkpoints(r["training_run_id"])),
                       key=lambda c: c["time"], reverse=True)
        return {"checkpoints": every[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(every)}}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/archive")
    def archive_url(model_id: str, kind: str, name: str, request: Request):
        """The SDK's get_checkpoint_archive_url (the cookbook's weights.download): a 302 to a URL
        that serves the checkpoint's folder as a tar for 15 minutes, fetched without the API key
        (as the hosted service's signed URLs are)."""
        import email.utils

        token, expires = registry.archive_token(f"tinker://{model_id}/{kind}/{name}")
        url = f"{str(request.base_url).rstrip('/')}/api/v1/archives/{token}/{name}.tar"
        return Response(status_code=302, headers={"Location": url,
                                                  "Expires": email.utils.formatdate(expires, usegmt=True)})

    @app.get("/api/v1/archives/{token}/{filename}")
    def archive(token: str, filename: str):
        """The checkpoint's files at the archive's top level (a peft folder for sampler weights)."""
        import os
        import tarfile
        import tempfile

        from fastapi.responses import FileResponse
        from starlette.background import BackgroundTask

        folder, _ = registry.archive(token)
        fd, tmp = tempfile.mkstemp(suffix=".tar")
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
            for entry in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, entry), arcname=entry)
        return FileResponse(tmp, media_type="application/x-tar", filename=filename,
                            background=BackgroundTask(os.remove, tmp))

    # ---- sampling -------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await body_of(request)
        sampler = service.create_sampler(need(body, "session_id"), need(body, "sampling_session_seq_id", int),
                                         body.get("base_model"), body.get("model_path"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        sampler = registry.sampler(sampler_id)
        return {"sampler_id": sampler.id, "base_model": service.model_name, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        request_id, sequence_ids = service.sample(await body_of(request))
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # ---- futures ---------------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = need(await body_of(request), "request_id")
        future = service.futures.get(request_id)[0]
        if not future.done():
            left = service.futures.left_s(request_id)
            await asyncio.wait({asyncio.wrap_future(future)}, timeout=max(0.0, min(s.poll_s, left)))
            if not future.done():
                if left > s.poll_s:
                    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
                future = service.futures.give_up(request_id)
        if future.cancelled():
            return {"error": "the call was cancelled", "category": "user"}
        err = future.exception()
        if err is not None:
            user = isinstance(err, (UserError, ValueError))
            if not user:
                log.warning("request %s failed: %s: %s", request_id, type(err).__name__, err)
            return {"error": f"{type(err).__name__}: {err}" if not user else str(err),
                    "category": "user" if user else "server"}
        result = future.result()
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return result

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request):
        service.futures.cancel(need(await body_of(request), "request_id"))
        return {}

    # ---- everything else -------------------------------------------------------------------------

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def not_served(request: Request, path: str):
        """A route this service does not serve (a newer SDK's call, REST calls such as publish or
        TTLs): 404, naming it; a training call's seq_id in its JSON body is given up."""
        try:
            await body_of(request)
        except UserError:
            pass
        give_up_number(request)
        return _detail(404, f"{request.method} /{path} is not served by this service (docs/tinker-service.md lists "
                            "what is)")

    return app
