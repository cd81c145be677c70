"""``lenscope serve``: a local web app over every report view, and the HTTP API it uses (see ``docs/serve.md``).

>>> app = create_app(["smollm2"])            # an ASGI app (Starlette)          # doctest: +SKIP
>>> serve(port=8000, models=["smollm2"])     # runs it with uvicorn             # doctest: +SKIP

:mod:`.app` is the HTTP layer (routes, token, errors, security headers), :mod:`.api` what each route computes
(the report's views on a shared context, a head, a token, the static page), :mod:`.jobs` the workers (one per
model), the caches and the pool of loaded models.
"""

from __future__ import annotations

from .app import create_app, serve

__all__ = ["create_app", "serve"]
