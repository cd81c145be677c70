"""The HTTP layer of ``lenscope serve`` (Starlette): routes, the token check, JSON errors, the security headers on
every response, the static assets, and the hand-off of each computation to its model's worker
(:class:`~lenscope.serve.jobs.Jobs`), dropped when the client goes away before it starts."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import re
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse
from starlette.routing import Route

from ..errors import InputError, LenscopeError, NotApplicableError, Stopped, UnknownModelError
from ..report import SECTIONS
from .api import Service
from .jobs import ApiError

log = logging.getLogger("lenscope.serve")

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]
MAX_BODY = 1 << 20  # bytes of a request's JSON
_VIZ = Path(__file__).resolve().parent.parent / "viz"
ASSET_DIRS = (_VIZ / "report" / "assets", _VIZ / "app" / "assets")
_ASSET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.(js|css|svg|png|woff2)$")
MEDIA = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8", "svg": "image/svg+xml",
         "png": "image/png", "woff2": "font/woff2"}
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


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _status(e: BaseException) -> int:
    if isinstance(e, ApiError):
        return e.status
    if isinstance(e, Stopped):
        return 499  # its client has gone: nobody reads this answer
    if isinstance(e, UnknownModelError):
        return 404
    if isinstance(e, (InputError, NotApplicableError, LenscopeError)):
        return 400
    return 500


def _line(e: BaseException) -> str:
    s = str(getattr(e, "message", None) or e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _as_response(e: BaseException) -> JSONResponse:
    status = _status(e)
    if status == 500:
        log.error("computation failed", exc_info=e)
        return error(500, f"the computation failed ({type(e).__name__}: {_line(e)}); the server is still serving: "
                          "try another input or view, and report this if it persists")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return error(status, _line(e), headers)


def _localhost(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


def create_app(models: list[str] | None = None, *, token: str | None = None, max_tokens: int = 512,
               max_queue: int = 16, max_resident: int = 2, lens: str | None = None, loader=None,
               dicts: str | None = None, dict_data: str | None = None) -> Starlette:
    """The ``lenscope serve`` application (ASGI, Starlette). ``models``: the registered names a client may ask for
    (default :func:`lenscope.models.load.available_names`; the first is the page's default); ``token``: require
    ``Authorization: Bearer <token>`` on every API request; ``max_tokens``: tokens per request (413 above);
    ``max_queue``: jobs waiting in all (503 above); ``max_resident``: models kept loaded; ``lens``: a tuned-lens
    directory shown beside the logit lens for the model it fits; ``dicts``: sparse dictionaries (a folder, or a
    folder of them) for the features view and ``/api/features``, those that fit each model (with transcoders: the
    attribution graph, ``/api/graph`` and ``/api/supernode``); ``dict_data``: text whose
    held-out part ``/api/feature``'s cards are measured on. ``loader(name) -> LoadedModel`` replaces
    :func:`lenscope.load` (tests)."""
    from ..models.families import tiny_names
    from ..models.load import available_names

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
        from ..models.dictionary import load_dictionaries

        load_dictionaries(dicts)  # an unreadable folder is refused at start
    if dict_data is not None:
        if dicts is None:
            raise InputError("--dict-data measures the feature cards of --dict: give --dict DIR as well")
        from ..data.corpus import corpus_files

        corpus_files(dict_data)
    seq2seq = [m for m in models if encoder_decoder(m, tiny_names())]  # the page's source field and alignment view
    svc = Service(models, max_tokens=max_tokens, max_queue=max_queue, max_resident=max_resident, lens=lens,
                  loader=loader, dicts=dicts, dict_data=dict_data)

    def authorize(request: Request, query_ok: bool = False) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), token.encode()):
            return
        q = request.query_params.get("token")
        if query_ok and q is not None and hmac.compare_digest(q.encode(), token.encode()):
            return
        raise ApiError(401, "this server needs its token: send the header 'Authorization: Bearer <token>' (the page "
                            "reads it from its address, http://host:port/?token=<token>)")

    def model_name(value) -> str:
        if value is None:
            return models[0]
        if not isinstance(value, str) or value not in models:
            raise ApiError(404, f"unknown model {value!r}; this server serves {', '.join(models)} (GET /api/models)")
        return value

    async def body_json(request: Request) -> dict:
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY} bytes; send a shorter text")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON; send a JSON object such as "
                                '{"model": "...", "text": "..."}') from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object such as "
                                '{"model": "...", "text": "..."}')
        return body

    def text_of(d) -> str:
        text = d.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "the text is missing or empty; give a non-empty \"text\"")
        return text

    async def text_request(request: Request) -> tuple[dict, str, str]:
        """What every POST view starts with: the token checked, then the JSON body, its model's name (the first
        served by default) and its non-empty text."""
        authorize(request)
        d = await body_json(request)
        return d, model_name(d.get("model")), text_of(d)

    def token_spec(d, key: str):
        v = d.get(key)
        if v is None or v == "":
            return None
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise ApiError(400, f"\"{key}\" must be a token's text (e.g. \" Paris\"), \"#ID\" or an integer id")
        return v

    def opt_text(d, key: str):
        v = d.get(key)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise ApiError(400, f"\"{key}\" must be a text")
        return v

    def integer(d, key: str) -> int:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, str) and re.fullmatch(r"-?\d+", v.strip()):
                return int(v)
            raise ApiError(400, f"\"{key}\" must be an integer")
        return v

    async def run(request: Request, name: str, fn):
        """Run ``fn`` in the model's worker. When the client disconnects (the page aborts the requests of an input it
        leaves), the job is dropped if it has not started, else stopped at its next chunk, so the next input's
        views wait for at most the chunk in progress."""
        fut = svc.jobs.submit(name, fn)
        wrapped = asyncio.wrap_future(fut)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({wrapped, gone}, return_when=asyncio.FIRST_COMPLETED)
            if wrapped.done():
                return wrapped.result()
            how = fut.stop()  # "dropped" before it ran, "stopping" at its next chunk (nothing cached), or "done"
            wrapped.cancel()  # nobody reads its outcome
            log.info("client went away; job %s", how)
            raise ApiError(499, "the client closed the request")
        finally:
            gone.cancel()

    async def disconnected(request: Request) -> None:
        """Returns when the client has gone (the body is read, so the next ASGI message is the disconnect)."""
        while True:
            if (await request.receive())["type"] == "http.disconnect":
                return

    def endpoint(fn):
        async def wrapper(request: Request):
            try:
                return await fn(request)
            except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error; the server keeps serving
                return _as_response(e)

        return wrapper

    @endpoint
    async def page(request: Request):
        authorize(request, query_ok=True)
        try:
            from ..viz.app import app_html
        except ImportError:
            return HTMLResponse("<!doctype html><title>lenscope serve</title><p>lenscope serve: the page is not "
                                "installed yet; the API answers at /api/models and /api/analyze.</p>")
        kw = {}
        if "views" in inspect.signature(app_html).parameters:  # the cards' titles: the report's own
            kw["views"] = [{"key": c.key, "title": c.title, "blurb": c.blurb} for c in SECTIONS]
        if "features" in inspect.signature(app_html).parameters:
            kw["features"] = dicts is not None
        if "seq2seq" in inspect.signature(app_html).parameters:
            kw["seq2seq"] = seq2seq
        return HTMLResponse(app_html(models=models, default=models[0], token_required=token is not None,
                                     max_tokens=svc.max_tokens, **kw))

    @endpoint
    async def static(request: Request):
        name = request.path_params["name"]
        if _ASSET_NAME.match(name):
            for d in ASSET_DIRS:
                if d.is_dir() and name in {p.name for p in d.iterdir() if p.is_file()}:
                    return FileResponse(d / name, media_type=MEDIA[name.rsplit(".", 1)[1]],
                                        headers={"Cache-Control": "no-cache"})
        return error(404, f"no asset {name!r}; /static/ serves only the page's own scripts and styles")

    @endpoint
    async def api_models(request: Request):
        authorize(request)
        return JSONResponse({"models": svc.models_info(), "default": models[0], "max_tokens": svc.max_tokens,
                             "max_resident": svc.max_resident})

    @endpoint
    async def api_analyze(request: Request):
        d, name, text = await text_request(request)
        target, foil, corrupted = token_spec(d, "target"), token_spec(d, "foil"), opt_text(d, "corrupted")
        sections = d.get("sections")
        if sections is not None:
            if isinstance(sections, str):
                sections = [s.strip() for s in sections.split(",") if s.strip()]
            if not isinstance(sections, list) or not sections or not all(isinstance(s, str) for s in sections):
                raise ApiError(400, "\"sections\" must be a non-empty list of view keys")
        svc.section_keys(sections)  # unknown keys: 400 before queueing
        hit = svc.analyze(name, text, target, foil, corrupted, sections, cached_only=True)
        if hit is None:
            hit = await run(request, name, lambda: svc.analyze(name, text, target, foil, corrupted, sections))
        return JSONResponse(hit)

    @endpoint
    async def api_head(request: Request):
        d, name, text = await text_request(request)
        layer, head = integer(d, "layer"), integer(d, "head")
        args = (name, text, layer, head, token_spec(d, "target"), token_spec(d, "foil"), opt_text(d, "corrupted"))
        return JSONResponse(await run(request, name, lambda: svc.head(*args)))

    @endpoint
    async def api_token(request: Request):
        d, name, text = await text_request(request)
        args = (name, text, integer(d, "position"), token_spec(d, "target"), token_spec(d, "foil"))
        return JSONResponse(await run(request, name, lambda: svc.token(*args)))

    @endpoint
    async def api_features(request: Request):
        authorize(request)
        d = await body_json(request)
        name = model_name(d.get("model"))
        text = text_of(d)
        position = integer(d, "position")
        return JSONResponse(await run(request, name, lambda: svc.features(name, text, position)))

    @endpoint
    async def api_feature(request: Request):
        authorize(request)
        d = await body_json(request)
        name = model_name(d.get("model"))
        site = d.get("site")
        if not isinstance(site, str) or not site:
            raise ApiError(400, "\"site\" must name a dictionary's site, e.g. \"resid_post.5\"")
        feature = integer(d, "feature")
        return JSONResponse(await run(request, name, lambda: svc.feature(name, site, feature)))

    @endpoint
    async def api_graph(request: Request):
        d, name, text = await text_request(request)
        target = token_spec(d, "target")
        return JSONResponse(await run(request, name, lambda: svc.graph(name, text, target)))

    @endpoint
    async def api_supernode(request: Request):
        d, name, text = await text_request(request)
        target, label, ids = token_spec(d, "target"), d.get("label"), d.get("ids")
        if not isinstance(label, str) or not label.strip():
            raise ApiError(400, "\"label\" must be a non-empty text, the supernode's name")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, "\"ids\" must be a non-empty list of the graph's node ids (e.g. \"0_12_3\")")
        return JSONResponse(await run(request, name, lambda: svc.supernode(name, text, target, label.strip(), ids)))

    @endpoint
    async def api_alignment(request: Request):
        authorize(request)
        d = await body_json(request)
        name = model_name(d.get("model"))
        source, target = d.get("source"), d.get("target")
        for key, v in (("source", source), ("target", target)):
            if not isinstance(v, str) or not v.strip():
                raise ApiError(400, f"the {key} is missing or empty; give a non-empty \"{key}\" (a translation: the "
                                    "source and its target)")
        methods = d.get("methods")
        if methods is not None and (not isinstance(methods, list) or not methods
                                    or not all(isinstance(m, str) for m in methods)):
            raise ApiError(400, "\"methods\" must be a non-empty list of method names, e.g. [\"logit\"]")
        gold = d.get("gold")
        if gold is not None:
            if not isinstance(gold, dict) or "sure" not in gold or set(gold) - {"sure", "possible"}:
                raise ApiError(400, "\"gold\" must be an object {\"sure\": [[i, j], ...], \"possible\": [...]} "
                                    "(source word i, target word j, 0-based)")
        return JSONResponse(await run(request, name, lambda: svc.alignment(name, source, target, methods, gold)))

    @endpoint
    async def api_report(request: Request):
        authorize(request, query_ok=True)
        q = dict(request.query_params)
        name = model_name(q.get("model"))
        text = text_of(q)
        args = (name, text, token_spec(q, "target"), token_spec(q, "foil"), opt_text(q, "corrupted"))
        html = await run(request, name, lambda: svc.report(*args))
        return HTMLResponse(html, headers={"Content-Disposition": 'attachment; filename="lenscope-report.html"'})

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error(404, f"no such route {request.url.path!r}; the API is /api/models, /api/analyze, "
                              "/api/head, /api/token, /api/features, /api/feature, /api/graph, /api/supernode, "
                              "/api/alignment, /api/report")
        if exc.status_code == 405:
            return error(405, f"{request.method} is not allowed on {request.url.path}", dict(exc.headers or {}))
        return error(exc.status_code, str(exc.detail))

    @asynccontextmanager
    async def lifespan(app):
        yield
        svc.close()

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/static/{name}", static, methods=["GET"]),
        Route("/api/models", api_models, methods=["GET"]),
        Route("/api/analyze", api_analyze, methods=["POST"]),
        Route("/api/head", api_head, methods=["POST"]),
        Route("/api/token", api_token, methods=["POST"]),
        Route("/api/features", api_features, methods=["POST"]),
        Route("/api/feature", api_feature, methods=["POST"]),
        Route("/api/graph", api_graph, methods=["POST"]),
        Route("/api/supernode", api_supernode, methods=["POST"]),
        Route("/api/alignment", api_alignment, methods=["POST"]),
        Route("/api/report", api_report, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.add_middleware(SecurityHeaders)
    app.state.service = svc
    return app


def encoder_decoder(name: str, tiny: dict) -> bool:
    """Whether model ``name`` is an encoder-decoder (translation) model, before it is loaded: a registered tiny one of
    such a family, or a folder whose ``config.json`` says ``is_encoder_decoder``."""
    if name.startswith("tiny:") and name[5:] in tiny:
        return bool(tiny[name[5:]].encoder_decoder)
    config = Path(name).expanduser() / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("is_encoder_decoder")) if config.is_file() else False
    except (OSError, ValueError):
        return False


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
