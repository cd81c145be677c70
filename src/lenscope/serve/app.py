"""The HTTP layer of ``lenscope serve`` (Starlette): the application, its settings checked at start, JSON errors and
the security headers on every response. The routes, the token check and the hand-off of each computation to its
model's worker are :class:`~lenscope.serve.routes.Handlers`."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from ..errors import InputError, UnknownModelError
from .api import Service
from .routes import API_ROUTES, Handlers, error

log = logging.getLogger("lenscope.serve")

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class SecurityHeaders:
    """ASGI middleware: the Content-Security-Policy (no third-party origin, no inline script) and friends on every
    HTTP response, errors included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (k, v) for k, v in SECURITY_HEADERS if k not in names]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _localhost(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


def _check_settings(models: list[str] | None, max_tokens: int, max_queue: int, max_resident: int, dicts: str | None,
                    dict_data: str | None) -> list[str]:
    """The served names (default :func:`lenscope.models.loading.load.available_names`), each a registered name or an
    existing
    path, and the limits and dictionaries checked, before anything starts."""
    from ..models.loading.load import available_names

    known = list(available_names())
    models = list(dict.fromkeys(known if models is None else models))
    if not models:
        raise InputError("no models to serve: give at least one --model")
    for m in models:  # the operator may name a local folder or .gguf file; clients only ever name these strings
        if m not in known and not Path(m).expanduser().exists():
            raise UnknownModelError(f"unknown model {m!r}: not a registered name ({', '.join(known)}), a "
                                    "transformers folder or a .gguf file")
    for v, what in ((max_tokens, "--max-tokens"), (max_resident, "--max-resident")):
        if int(v) < 1:
            raise InputError(f"{what} must be at least 1")
    if int(max_queue) < 0:
        raise InputError("--max-queue must be at least 0")
    if dicts is not None:
        from ..models.dictionaries.dictionary import load_dictionaries

        load_dictionaries(dicts)  # an unreadable folder is refused at start
    if dict_data is not None:
        if dicts is None:
            raise InputError("--dict-data measures the feature cards of --dict: give --dict DIR as well")
        from ..data.corpus import corpus_files

        corpus_files(dict_data)
    return models


def create_app(models: list[str] | None = None, *, token: str | None = None, max_tokens: int = 512,
               max_queue: int = 16, max_resident: int = 2, lens: str | None = None, loader=None,
               dicts: str | None = None, dict_data: str | None = None) -> Starlette:
    """The ``lenscope serve`` application (ASGI, Starlette). ``models``: the registered names a client may ask for
    (default :func:`lenscope.models.loading.load.available_names`; the first is the page's default); ``token``: require
    ``Authorization: Bearer <token>`` on every API request; ``max_tokens``: tokens per request (413 above);
    ``max_queue``: jobs waiting in all (503 above); ``max_resident``: models kept loaded; ``lens``: a tuned-lens
    directory shown beside the logit lens for the model it fits; ``dicts``: sparse dictionaries (a folder, or a
    folder of them) for the features view and ``/api/features``, those that fit each model (with transcoders: the
    attribution graph, ``/api/graph`` and ``/api/supernode``); ``dict_data``: text whose
    held-out part ``/api/feature``'s cards are measured on. ``loader(name) -> LoadedModel`` replaces
    :func:`lenscope.load` (tests). Every view is also at ``/api/view/<key>`` (:mod:`lenscope.serve.routes`)."""
    from ..models.loading.load import is_encoder_decoder

    models = _check_settings(models, max_tokens, max_queue, max_resident, dicts, dict_data)
    seq2seq = [m for m in models if is_encoder_decoder(m)]  # the page's source field and alignment view
    svc = Service(models, max_tokens=max_tokens, max_queue=max_queue, max_resident=max_resident, lens=lens,
                  loader=loader, dicts=dicts, dict_data=dict_data)
    h = Handlers(svc, models, token=token, dicts=dicts, seq2seq=seq2seq)

    @asynccontextmanager
    async def lifespan(app):
        yield
        svc.close()

    app = Starlette(routes=h.routes(), exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.add_middleware(SecurityHeaders)
    app.state.service = svc
    return app


async def http_error(request: Request, exc: HTTPException):
    if exc.status_code == 404:
        return error(404, f"no such route {request.url.path!r}; the API is {', '.join(API_ROUTES)}")
    if exc.status_code == 405:
        return error(405, f"{request.method} is not allowed on {request.url.path}", dict(exc.headers or {}))
    return error(exc.status_code, str(exc.detail))


def url(host: str, port: int, token: str | None = None) -> str:
    """The address to open: ``http://host:port/`` (with ``?token=`` when one is set)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve(host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info", **kwargs) -> None:
    """Run :func:`create_app` (``kwargs``: ``models``, ``token``, ``max_tokens``, ``max_queue``, ``max_resident``,
    ``lens``, ``dicts``, ``dict_data``) with uvicorn on ``host:port``; prints the address to open. A host other than
    localhost needs a ``token`` (:class:`~lenscope.errors.InputError` otherwise)."""
    import uvicorn

    if not _localhost(host) and not kwargs.get("token"):
        raise InputError(f"--host {host} makes the server reachable from other machines: give --token as well "
                         "(or keep the default 127.0.0.1)")
    app = create_app(**kwargs)
    names = app.state.service.models
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(message)s")
    print(f"lenscope serve: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} (default {names[0]}; "
          "each model is loaded on its first request, which then takes a while)", flush=True)
    print(f"open {url(host, port, kwargs.get('token'))}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
