"""What every browser test shares: a Playwright page whose requests outside ``allowed`` URL prefixes are blocked
and recorded, with console and page errors collected."""

from __future__ import annotations


def isolated_page(browser, allowed: tuple[str, ...], **context_options):
    """``(context, page, errors, blocked)``: a new context and page; a request whose URL starts with none of
    ``allowed`` is aborted and its URL appended to ``blocked``; console errors and page errors go to ``errors``."""
    ctx = browser.new_context(**context_options)
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith(allowed):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return ctx, page, errors, blocked
