"""The routes of ``lenscope serve``: the token check, a request's fields read and checked (400 with one line that
says what to send), JSON errors, the static assets, and the hand-off of each computation to its model's worker
(:class:`~lenscope.serve.jobs.Jobs`), dropped when the client goes away before it starts.

Every view of the report is answered by one generic route, ``/api/view/<key>`` (``POST``: its data as JSON; ``GET``:
its self-contained page), found by discovery (:mod:`lenscope.viz.views`, :data:`lenscope.report.SECTIONS`), besides
the routes the docs name (``docs/serve.md``)."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import re

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse
from starlette.routing import Route

from ..errors import InputError, LenscopeError, NotApplicableError, Stopped, UnknownModelError
from .jobs import ApiError

log = logging.getLogger("lenscope.serve")

MAX_BODY = 1 << 20  # bytes of a request's JSON
_ASSET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.(js|css|svg|png|woff2)$")
MEDIA = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8", "svg": "image/svg+xml",
         "png": "image/png", "woff2": "font/woff2"}
API_ROUTES = ("/api/models", "/api/analyze", "/api/head", "/api/token", "/api/features", "/api/feature", "/api/graph",
              "/api/supernode", "/api/alignment", "/api/report", "/api/view/<key>")


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


def as_response(e: BaseException) -> JSONResponse:
    """An exception as the JSON error a client reads (a failure of lenscope's own: 500, logged)."""
    status = _status(e)
    if status == 500:
        log.error("computation failed", exc_info=e)
        return error(500, f"the computation failed ({type(e).__name__}: {_line(e)}); the server is still serving: "
                          "try another input or view, and report this if it persists")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return error(status, _line(e), headers)


def endpoint(fn):
    """An endpoint whose every failure becomes a JSON error (the server keeps serving)."""

    async def wrapper(request: Request):
        try:
            return await fn(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error; the server keeps serving
            return as_response(e)

    return wrapper


# ------------------------------------------------------------------------------------ a request's fields


def text_of(d) -> str:
    text = d.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "the text is missing or empty; give a non-empty \"text\"")
    return text


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


def sections_of(d) -> list[str] | None:
    sections = d.get("sections")
    if sections is not None:
        if isinstance(sections, str):
            sections = [s.strip() for s in sections.split(",") if s.strip()]
        if not isinstance(sections, list) or not sections or not all(isinstance(s, str) for s in sections):
            raise ApiError(400, "\"sections\" must be a non-empty list of view keys")
    return sections


def alignment_fields(d) -> tuple:
    """``(source, target, methods, gold)`` of an ``/api/alignment`` request, checked."""
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
    return source, target, methods, gold


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------- handlers


class Handlers:
    """The endpoints of one server: its :class:`~lenscope.serve.api.Service`, the served ``models`` (the first is
    the default), its ``token`` (None: no check), whether it has dictionaries (``dicts``) and its encoder-decoder
    models (``seq2seq``)."""

    def __init__(self, svc, models: list[str], *, token: str | None, dicts: str | None, seq2seq: list[str]):
        self.svc, self.models, self.token, self.dicts, self.seq2seq = svc, models, token, dicts, seq2seq

    def routes(self) -> list[Route]:
        ep = endpoint
        return [
            Route("/", ep(self.page), methods=["GET"]),
            Route("/static/{name}", ep(self.static), methods=["GET"]),
            Route("/api/models", ep(self.api_models), methods=["GET"]),
            Route("/api/analyze", ep(self.api_analyze), methods=["POST"]),
            Route("/api/head", ep(self.api_head), methods=["POST"]),
            Route("/api/token", ep(self.api_token), methods=["POST"]),
            Route("/api/features", ep(self.api_features), methods=["POST"]),
            Route("/api/feature", ep(self.api_feature), methods=["POST"]),
            Route("/api/graph", ep(self.api_graph), methods=["POST"]),
            Route("/api/supernode", ep(self.api_supernode), methods=["POST"]),
            Route("/api/alignment", ep(self.api_alignment), methods=["POST"]),
            Route("/api/report", ep(self.api_report), methods=["GET"]),
            Route("/api/view/{key}", ep(self.api_view), methods=["GET", "POST"]),
        ]

    # -------------------------------------------------------------------------------------- requests

    def authorize(self, request: Request, query_ok: bool = False) -> None:
        token = self.token
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

    def model_name(self, value) -> str:
        if value is None:
            return self.models[0]
        if not isinstance(value, str) or value not in self.models:
            raise ApiError(404, f"unknown model {value!r}; this server serves {', '.join(self.models)} "
                                "(GET /api/models)")
        return value

    async def body_json(self, request: Request) -> dict:
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

    async def text_request(self, request: Request) -> tuple[dict, str, str]:
        """What every POST view starts with: the token checked, then the JSON body, its model's name (the first
        served by default) and its non-empty text."""
        self.authorize(request)
        d = await self.body_json(request)
        return d, self.model_name(d.get("model")), text_of(d)

    def query_request(self, request: Request) -> tuple[dict, str, str]:
        """What every GET page starts with: the token checked (the header or ``?token=``), the query's model name
        and its non-empty text."""
        self.authorize(request, query_ok=True)
        q = dict(request.query_params)
        return q, self.model_name(q.get("model")), text_of(q)

    async def run(self, request: Request, name: str, fn):
        """Run ``fn`` in the model's worker. When the client disconnects (the page aborts the requests of an input
        it leaves), the job is dropped if it has not started, else stopped at its next chunk, so the next input's
        views wait for at most the chunk in progress."""
        fut = self.svc.jobs.submit(name, fn)
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

    # ----------------------------------------------------------------------------------- the page, files

    async def page(self, request: Request):
        self.authorize(request, query_ok=True)
        try:
            from ..viz.app import app_html
        except ImportError:
            return HTMLResponse("<!doctype html><title>lenscope serve</title><p>lenscope serve: the page is not "
                                "installed yet; the API answers at /api/models and /api/analyze.</p>")
        from ..report import SECTIONS

        kw, params = {}, inspect.signature(app_html).parameters
        if "views" in params:  # the cards' titles: the report's own
            kw["views"] = [{"key": c.key, "title": c.title, "blurb": c.blurb} for c in SECTIONS]
        if "features" in params:
            kw["features"] = self.dicts is not None
        if "seq2seq" in params:
            kw["seq2seq"] = self.seq2seq
        return HTMLResponse(app_html(models=self.models, default=self.models[0], token_required=self.token is not None,
                                     max_tokens=self.svc.max_tokens, **kw))

    async def static(self, request: Request):
        from ..viz.app import asset_path

        name = request.path_params["name"]
        path = asset_path(name) if _ASSET_NAME.match(name) else None
        if path is not None:
            return FileResponse(path, media_type=MEDIA[name.rsplit(".", 1)[1]], headers={"Cache-Control": "no-cache"})
        return error(404, f"no asset {name!r}; /static/ serves only the page's own scripts and styles")

    # ---------------------------------------------------------------------------------------- the API

    async def api_models(self, request: Request):
        self.authorize(request)
        svc = self.svc
        return JSONResponse({"models": svc.models_info(), "default": self.models[0], "max_tokens": svc.max_tokens,
                             "max_resident": svc.max_resident})

    async def api_analyze(self, request: Request):
        d, name, text = await self.text_request(request)
        target, foil, corrupted = token_spec(d, "target"), token_spec(d, "foil"), opt_text(d, "corrupted")
        sections, svc = sections_of(d), self.svc
        svc.section_keys(sections)  # unknown keys: 400 before queueing
        hit = svc.analyze(name, text, target, foil, corrupted, sections, cached_only=True)
        if hit is None:
            hit = await self.run(request, name, lambda: svc.analyze(name, text, target, foil, corrupted, sections))
        return JSONResponse(hit)

    async def api_head(self, request: Request):
        d, name, text = await self.text_request(request)
        layer, head = integer(d, "layer"), integer(d, "head")
        args = (name, text, layer, head, token_spec(d, "target"), token_spec(d, "foil"), opt_text(d, "corrupted"))
        return JSONResponse(await self.run(request, name, lambda: self.svc.head(*args)))

    async def api_token(self, request: Request):
        d, name, text = await self.text_request(request)
        args = (name, text, integer(d, "position"), token_spec(d, "target"), token_spec(d, "foil"))
        return JSONResponse(await self.run(request, name, lambda: self.svc.token(*args)))

    async def api_features(self, request: Request):
        self.authorize(request)
        d = await self.body_json(request)
        name = self.model_name(d.get("model"))
        text = text_of(d)
        position = integer(d, "position")
        return JSONResponse(await self.run(request, name, lambda: self.svc.features(name, text, position)))

    async def api_feature(self, request: Request):
        self.authorize(request)
        d = await self.body_json(request)
        name = self.model_name(d.get("model"))
        site = d.get("site")
        if not isinstance(site, str) or not site:
            raise ApiError(400, "\"site\" must name a dictionary's site, e.g. \"resid_post.5\"")
        feature = integer(d, "feature")
        return JSONResponse(await self.run(request, name, lambda: self.svc.feature(name, site, feature)))

    async def api_graph(self, request: Request):
        d, name, text = await self.text_request(request)
        target = token_spec(d, "target")
        return JSONResponse(await self.run(request, name, lambda: self.svc.graph(name, text, target)))

    async def api_supernode(self, request: Request):
        d, name, text = await self.text_request(request)
        target, label, ids = token_spec(d, "target"), d.get("label"), d.get("ids")
        if not isinstance(label, str) or not label.strip():
            raise ApiError(400, "\"label\" must be a non-empty text, the supernode's name")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, "\"ids\" must be a non-empty list of the graph's node ids (e.g. \"0_12_3\")")
        args = (name, text, target, label.strip(), ids)
        return JSONResponse(await self.run(request, name, lambda: self.svc.supernode(*args)))

    async def api_alignment(self, request: Request):
        self.authorize(request)
        d = await self.body_json(request)
        name = self.model_name(d.get("model"))
        args = (name, *alignment_fields(d))
        return JSONResponse(await self.run(request, name, lambda: self.svc.alignment(*args)))

    async def api_report(self, request: Request):
        q, name, text = self.query_request(request)
        args = (name, text, token_spec(q, "target"), token_spec(q, "foil"), opt_text(q, "corrupted"))
        html = await self.run(request, name, lambda: self.svc.report(*args))
        return HTMLResponse(html, headers={"Content-Disposition": 'attachment; filename="lenscope-report.html"'})

    async def api_view(self, request: Request):
        """``/api/view/<key>``: any view of the report (a plug-in's too) on one input: ``POST`` a JSON body
        (``model``, ``text``, ``target``, ``foil``, ``corrupted``) for its data, checks and seconds; ``GET`` with
        the same fields in the query for its self-contained page (the report page holding just that view)."""
        key = request.path_params["key"]
        if key not in self.svc.view_keys():
            raise ApiError(404, f"no view {key!r}; the views are {', '.join(self.svc.view_keys())}")
        if request.method == "GET":
            d, name, text = self.query_request(request)
        else:
            d, name, text = await self.text_request(request)
        args = (name, key, text, token_spec(d, "target"), token_spec(d, "foil"), opt_text(d, "corrupted"))
        if request.method == "GET":
            return HTMLResponse(await self.run(request, name, lambda: self.svc.view_page(*args)))
        return JSONResponse(await self.run(request, name, lambda: self.svc.view(*args)))
